"""NVIDIA GPU confidential-computing evidence (Hopper, Blackwell), verified offline.

The GPU's attestation report is what its driver returns: the SPDM 1.1 GET_MEASUREMENTS request
(37 bytes, carrying the verifier's 32-byte nonce) followed by the GPU's MEASUREMENTS response:
measurement blocks, the GPU's own nonce, opaque data (driver and VBIOS versions among others) and
an ECDSA P-384 / SHA-384 signature (raw r || s) over the request and the response before it. The
signing key is the GPU's attestation key; its certificate chains, through the chip's device
certificate and NVIDIA's intermediates, to NVIDIA's Device Identity CA, pinned in `nvidia/`.
Layouts follow DMTF's SPDM 1.1 (DSP0274); NVIDIA's opaque-data field numbers are those its
verifier reads. The first check that fails raises one `AttestationError` naming it.
"""

from __future__ import annotations

import datetime
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import TypeVar

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
from cryptography.x509.oid import ExtensionOID, SignatureAlgorithmOID

from splitllm.attestation.handshake import ClientHandshake, Evidence
from splitllm.attestation.sealing import SealedChannel
from splitllm.attestation.tdx import TdxVerified
from splitllm.attestation.verify import AttestationError, Verified

NONCE_SIZE = 32
REQUEST_SIZE = 37  # version, code, param1, param2, nonce, slot
SIGNATURE_SIZE = 96  # ECDSA P-384: r and s, 48 big-endian bytes each
MAX_CHAIN = 5  # attestation key, device, NVIDIA's two intermediates, root
_SPDM_1_1 = 0x11
_GET_MEASUREMENTS, _MEASUREMENTS = 0xE0, 0x60
_SIGNATURE_REQUESTED = 0x01
_ALL_MEASUREMENTS = 0xFF
_DMTF = 0x01  # the measurement specification every block must follow
_MAX_OPAQUE = 1024  # SPDM 1.1's bound on OpaqueLength
_DRIVER_VERSION = 3  # NVIDIA's opaque-data field: the driver version, NUL-terminated
_UNDERSTOOD_CRITICAL = {ExtensionOID.BASIC_CONSTRAINTS, ExtensionOID.KEY_USAGE}
_DIGEST_LABEL = b"splitllm gpu evidence\x00"
_Extension = TypeVar("_Extension", bound=x509.ExtensionType)


@cache
def nvidia_root() -> x509.Certificate:
    """NVIDIA's Device Identity CA, the root of every GPU's attestation chain (source: nvidia/NOTICE)."""
    pem = (resources.files("splitllm.attestation") / "nvidia" / "device_identity_ca.pem").read_bytes()
    return x509.load_pem_x509_certificate(pem)


@dataclass(frozen=True)
class GpuEvidence:
    """One GPU's evidence as its driver returns it: the report, and the PEM chain leaf first."""

    report: bytes
    certificates: bytes


@dataclass(frozen=True)
class GpuReport:
    """A parsed report; `raw` keeps the exact bytes, since the signature covers them and not the fields."""

    raw: bytes
    nonce: bytes  # the verifier's, from the request
    measurements: Mapping[int, bytes]  # block index -> DMTF measurement value
    responder_nonce: bytes
    opaque: Mapping[int, bytes]  # NVIDIA's field number -> value
    signature: bytes

    @classmethod
    def parse(cls, raw: bytes) -> GpuReport:
        """Every length must add up exactly and every fixed field hold its one allowed value (ValueError otherwise)."""
        if len(raw) < REQUEST_SIZE + 8 + NONCE_SIZE + 2 + SIGNATURE_SIZE:
            raise ValueError(f"{len(raw)} bytes is shorter than any GET_MEASUREMENTS request and response")
        version, code, param1, param2 = raw[0:4]
        if (version, code, param1, param2, raw[36]) != (_SPDM_1_1, _GET_MEASUREMENTS, _SIGNATURE_REQUESTED,
                                                        _ALL_MEASUREMENTS, 0):
            raise ValueError("the request is not an SPDM 1.1 GET_MEASUREMENTS of all blocks, signed, from slot 0")
        response = raw[REQUEST_SIZE:]
        if tuple(response[0:4]) != (_SPDM_1_1, _MEASUREMENTS, 0, 0):
            raise ValueError("the response is not an SPDM 1.1 MEASUREMENTS from slot 0")
        count = response[4]
        if count == 0:
            raise ValueError("the response holds no measurement blocks")
        record_end = 8 + int.from_bytes(response[5:8], "little")
        nonce_end = record_end + NONCE_SIZE
        if nonce_end + 2 > len(response):
            raise ValueError("the measurement record runs past the response")
        opaque_size = int.from_bytes(response[nonce_end : nonce_end + 2], "little")
        opaque_end = nonce_end + 2 + opaque_size
        if opaque_size > _MAX_OPAQUE or opaque_end + SIGNATURE_SIZE != len(response):
            raise ValueError(
                f"the response is {len(response)} bytes; its fields add up to {opaque_end + SIGNATURE_SIZE}"
            )
        return cls(
            raw=bytes(raw),
            nonce=bytes(raw[4:36]),
            measurements=_blocks(response[8:record_end], count),
            responder_nonce=bytes(response[record_end:nonce_end]),
            opaque=_opaque(response[nonce_end + 2 : opaque_end]),
            signature=bytes(response[opaque_end:]),
        )

    @property
    def signed(self) -> bytes:
        """What the GPU signed: the request and the response up to its signature (SPDM 1.1 has no prefix)."""
        return self.raw[:-SIGNATURE_SIZE]

    @property
    def driver_version(self) -> str:
        return self.opaque.get(_DRIVER_VERSION, b"").split(b"\x00")[0].decode("ascii", "replace")


def _blocks(record: bytes, count: int) -> dict[int, bytes]:
    """The measurement blocks: index, specification, size, then a DMTF measurement (type, size, value)."""
    blocks: dict[int, bytes] = {}
    at = 0
    while at < len(record):
        if at + 7 > len(record):
            raise ValueError("a measurement block is cut short")
        index, spec, size = record[at], record[at + 1], int.from_bytes(record[at + 2 : at + 4], "little")
        value_size = int.from_bytes(record[at + 5 : at + 7], "little")
        if spec != _DMTF or size != 3 + value_size or at + 4 + size > len(record):
            raise ValueError(f"measurement block {index} is not a well-formed DMTF measurement")
        if index in blocks or index in (0, 0xFF):
            raise ValueError(f"measurement block index {index} is reserved or repeated")
        blocks[index] = bytes(record[at + 7 : at + 4 + size])
        at += 4 + size
    if len(blocks) != count:
        raise ValueError(f"the response announces {count} measurement blocks and holds {len(blocks)}")
    return blocks


def _opaque(data: bytes) -> dict[int, bytes]:
    """NVIDIA's opaque data: fields of a type (2 bytes), a size (2 bytes) and a value, each type once."""
    fields: dict[int, bytes] = {}
    at = 0
    while at < len(data):
        if at + 4 > len(data):
            raise ValueError("an opaque-data field is cut short")
        kind, size = struct.unpack_from("<HH", data, at)
        if at + 4 + size > len(data) or kind in fields:
            raise ValueError(f"opaque-data field {kind} runs past its end or is repeated")
        fields[kind] = bytes(data[at + 4 : at + 4 + size])
        at += 4 + size
    return fields


@dataclass(frozen=True)
class GpuPolicy:
    """What a client requires of a server's GPUs: a chain to one of `roots` (NVIDIA's, pinned, unless a
    test says otherwise) and, for each block index listed, a measurement among its golden values.

    Golden values come from NVIDIA's reference integrity manifests (RIMs) for the driver and VBIOS;
    this module does not fetch or verify RIMs, so a policy lists values checked beforehand.
    """

    roots: tuple[x509.Certificate, ...] = field(default_factory=lambda: (nvidia_root(),))
    measurements: Mapping[int, frozenset[bytes]] = field(default_factory=dict)


@dataclass(frozen=True)
class VerifiedGpu:
    """A GPU report that passed every check, and the attestation key's certificate that signed it."""

    report: GpuReport
    certificate: x509.Certificate


def _extension(cert: x509.Certificate, kind: type[_Extension]) -> _Extension | None:
    try:
        return cert.extensions.get_extension_for_class(kind).value
    except x509.ExtensionNotFound:
        return None


def _check_certificate(cert: x509.Certificate, depth: int, now: datetime.datetime) -> None:
    """One certificate's algorithms, validity and role: depth 0 signs reports, every other one signs certificates."""
    name = f"certificate {depth} ({cert.subject.rfc4514_string()})"
    if cert.signature_algorithm_oid != SignatureAlgorithmOID.ECDSA_WITH_SHA384:
        raise AttestationError("gpu-chain",
                               f"{name} is signed with algorithm {cert.signature_algorithm_oid.dotted_string}, "
                                            f"not ECDSA with SHA-384")
    key = cert.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp384r1":
        raise AttestationError("gpu-chain", f"{name} does not hold an ECDSA P-384 key")
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise AttestationError("gpu-chain",
                               f"{name} is not valid at {now:%Y-%m-%d} ({cert.not_valid_before_utc:%Y-%m-%d} "
                                            f"to {cert.not_valid_after_utc:%Y-%m-%d})")
    try:
        unknown = {e.oid.dotted_string for e in cert.extensions if e.critical and e.oid not in _UNDERSTOOD_CRITICAL}
        constraints = _extension(cert, x509.BasicConstraints)
        usage = _extension(cert, x509.KeyUsage)
    except ValueError as exc:  # a malformed or repeated extension
        raise AttestationError("gpu-chain", f"{name}: {exc}") from None
    if unknown:
        raise AttestationError("gpu-chain", f"{name} has critical extensions this verifier does not know: "
                                            f"{', '.join(sorted(unknown))}")
    if depth == 0:
        if constraints is not None and constraints.ca:
            raise AttestationError("gpu-chain", f"{name}, the attestation key's, is a CA certificate")
        if usage is None or not usage.digital_signature:
            raise AttestationError("gpu-chain", f"{name}, the attestation key's, does not allow digital signatures")
        return
    if constraints is None or not constraints.ca:
        raise AttestationError("gpu-chain", f"{name} issues a certificate but is not a CA (basicConstraints)")
    if constraints.path_length is not None and constraints.path_length < depth - 1:
        raise AttestationError("gpu-chain",
                               f"{name} allows {constraints.path_length} CAs below it; the chain has {depth - 1}")
    if usage is None or not usage.key_cert_sign:
        raise AttestationError("gpu-chain", f"{name} issues a certificate but its key usage does not allow it")


def verify_gpu_chain(certificates: bytes, roots: tuple[x509.Certificate, ...],
                     now: datetime.datetime) -> x509.Certificate:
    """The attestation key's certificate, once the PEM chain (leaf first) ends at a pinned root and each
    certificate is current, of the pinned algorithms and issued by the next; `gpu-chain` error otherwise."""
    try:
        chain = x509.load_pem_x509_certificates(certificates)
    except ValueError as exc:
        raise AttestationError("gpu-chain", f"the certificate chain does not parse ({exc})") from None
    if not 2 <= len(chain) <= MAX_CHAIN:
        raise AttestationError("gpu-chain", f"the chain has {len(chain)} certificates; 2 to {MAX_CHAIN} are accepted")
    if chain[-1] not in roots:
        raise AttestationError("gpu-chain",
                               f"the chain ends at {chain[-1].subject.rfc4514_string()}, not at a pinned root")
    for depth, cert in enumerate(chain):
        _check_certificate(cert, depth, now)
    for depth, (cert, issuer) in enumerate(zip(chain, chain[1:])):
        try:
            cert.verify_directly_issued_by(issuer)
        except (ValueError, TypeError, InvalidSignature):
            raise AttestationError("gpu-chain",
                                   f"certificate {depth} ({cert.subject.rfc4514_string()}) was not issued by "
                                   f"certificate {depth + 1} ({issuer.subject.rfc4514_string()})") from None
    return chain[0]


def verify_gpu_report_signature(report: GpuReport, certificate: x509.Certificate) -> None:
    """The report's ECDSA P-384 / SHA-384 signature by the attestation key over the request and response."""
    key = certificate.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp384r1":
        raise AttestationError("gpu-signature", "the attestation key is not an ECDSA P-384 key")
    half = SIGNATURE_SIZE // 2
    r, s = (int.from_bytes(report.signature[i : i + half], "big") for i in (0, half))
    try:
        key.verify(encode_dss_signature(r, s), report.signed, ec.ECDSA(hashes.SHA384()))
    except InvalidSignature:
        raise AttestationError("gpu-signature",
                               "the GPU report's signature does not verify under its attestation key") from None


def verify_gpu_evidence(
    evidence: GpuEvidence, nonce: bytes, policy: GpuPolicy | None = None, now: datetime.datetime | None = None
) -> VerifiedGpu:
    """Every check of one GPU's evidence, in order: parsing, chain, signature, nonce, then golden measurements."""
    if len(nonce) != NONCE_SIZE:
        raise ValueError(f"a GPU nonce is {NONCE_SIZE} bytes")
    policy = policy or GpuPolicy()
    now = now or datetime.datetime.now(datetime.UTC)
    try:
        report = GpuReport.parse(evidence.report)
    except ValueError as exc:
        raise AttestationError("gpu-evidence", f"the GPU report is malformed: {exc}") from None
    certificate = verify_gpu_chain(evidence.certificates, policy.roots, now)
    verify_gpu_report_signature(report, certificate)
    if report.nonce != nonce:
        raise AttestationError("gpu-nonce",
                               "the GPU report answers another nonce: replayed, or made for another handshake")
    for index, golden in sorted(policy.measurements.items()):
        value = report.measurements.get(index)
        if value not in golden:
            shown = "absent" if value is None else value.hex()
            raise AttestationError("gpu-measurement", f"GPU measurement {index} ({shown}) is not among the policy's "
                                                      f"golden values")
    return VerifiedGpu(report, certificate)


def gpu_evidence_digest(gpus: Sequence[GpuEvidence]) -> bytes:
    """SHA-512 over every GPU's report and chain, length-prefixed, in the order presented: what the CVM's
    report_data commits to (`handshake.composite_report_data`), so no GPU evidence can be swapped in transit."""
    digest = hashes.Hash(hashes.SHA512())
    digest.update(_DIGEST_LABEL + struct.pack(">I", len(gpus)))
    for gpu in gpus:
        for part in (gpu.report, gpu.certificates):
            digest.update(struct.pack(">I", len(part)) + part)
    return digest.finalize()


def finish_with_gpus(
    handshake: ClientHandshake,
    evidence: Evidence,
    gpus: Sequence[GpuEvidence],
    policy: GpuPolicy | None = None,
    now: datetime.datetime | None = None,
) -> tuple[SealedChannel, Verified | TdxVerified, tuple[VerifiedGpu, ...]]:
    """`ClientHandshake.finish` for a server whose GPUs hold the hidden states: each GPU's report must answer
    this handshake's nonce (fresh), and the CVM's report (SEV-SNP) or quote (TDX) must commit to exactly this
    GPU evidence (bound)."""
    if not gpus:
        raise AttestationError("gpu-evidence", "the server presents no GPU evidence")
    verified = tuple(verify_gpu_evidence(gpu, handshake.nonce, policy, now) for gpu in gpus)
    channel, cvm = handshake.finish(evidence, gpu_digest=gpu_evidence_digest(gpus))
    return channel, cvm, verified
