"""Checking SEV-SNP evidence against a policy: the report's form and guest settings, the vendor chain,
the report's signature, its binding to this handshake, and every field the policy bounds. The first
check that fails raises one `AttestationError` naming it; genuine and simulated evidence go through
the same code.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from splitllm.attestation.policy import Anchor, AttestationPolicy
from splitllm.attestation.snp import (
    HWID_OID, HWID_SIZE, POLICY_DEFINED, POLICY_RESERVED_ONE, REPORT_VERSIONS, SIGNATURE_ECDSA_P384_SHA384,
    SIGNER_INFO_DEFINED, SIGNING_KEY_VCEK, SIGNING_KEY_VLEK, SPL_OIDS, TCB_FIELDS, SnpReport, Tcb,
)

# AMD signs ARK, ASK and VCEK certificates with RSA-PSS, SHA-384, MGF1 with SHA-384 and a 48-byte salt,
# under 4096-bit keys; the VCEK is an ECDSA P-384 key. Nothing else is taken, whatever a certificate declares.
_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA384()), salt_length=48)
_CA_KEY_BITS = 4096


class AttestationError(RuntimeError):
    """The server's evidence failed `check`; nothing was sent to it."""

    def __init__(self, check: str, message: str) -> None:
        super().__init__(f"attestation failed ({check}): {message}; no hidden state was sent")
        self.check = check


@dataclass(frozen=True)
class Verified:
    """A report that passed every check, and the anchor whose chain it chained to."""

    report: SnpReport
    product: str
    simulated: bool


def _check_certificate(cert: x509.Certificate, issuer: x509.Certificate, role: str, now: datetime.datetime) -> None:
    """One link of the chain: AMD's algorithm, `issuer`'s signature and name, the role's key and
    constraints, and the validity period. Whatever cannot be read is refused, never raised as is."""
    try:
        _check_link(cert, issuer, role)
    except InvalidSignature:
        raise AttestationError("chain", f"the {role} certificate's signature does not verify") from None
    except (UnsupportedAlgorithm, ValueError, TypeError) as exc:
        raise AttestationError("chain",
                               f"the {role} certificate cannot be checked ({type(exc).__name__}: {exc})") from None
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise AttestationError("chain",
                               f"the {role} certificate is not valid now ({cert.not_valid_before_utc:%Y-%m-%d} "
                                        f"to {cert.not_valid_after_utc:%Y-%m-%d})")


def _check_link(cert: x509.Certificate, issuer: x509.Certificate, role: str) -> None:
    if cert.issuer != issuer.subject:
        raise AttestationError("chain", f"the {role} certificate names {cert.issuer.rfc4514_string()} as its issuer, "
                                        f"not {issuer.subject.rfc4514_string()}")
    algorithm = cert.signature_algorithm_oid
    if algorithm != x509.SignatureAlgorithmOID.RSASSA_PSS or not isinstance(cert.signature_hash_algorithm,
                                                                            hashes.SHA384):
        raise AttestationError("chain", f"the {role} certificate is signed with {algorithm.dotted_string}, not AMD's "
                                        f"RSA-PSS with SHA-384")
    signer = issuer.public_key()
    if not isinstance(signer, rsa.RSAPublicKey) or signer.key_size != _CA_KEY_BITS:
        raise AttestationError("chain", f"the {role} certificate's issuer key is not a {_CA_KEY_BITS}-bit RSA key")
    signer.verify(cert.signature, cert.tbs_certificate_bytes, _PSS, hashes.SHA384())
    try:
        constraints: x509.BasicConstraints | None = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        constraints = None
    if role == "VCEK":
        key = cert.public_key()
        if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP384R1):
            raise AttestationError("chain", "the VCEK is not an ECDSA P-384 key")
        if constraints is not None and constraints.ca:
            raise AttestationError("chain", "the VCEK certificate is a CA certificate")
        return
    try:
        usage: x509.KeyUsage | None = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        usage = None
    if constraints is None or not constraints.ca or usage is None or not usage.key_cert_sign:
        raise AttestationError("chain", f"the {role} certificate is not a CA allowed to sign certificates "
                                        f"(basicConstraints CA and keyUsage keyCertSign)")


def verify_chain(vcek: x509.Certificate, anchors: tuple[Anchor, ...], now: datetime.datetime | None = None) -> Anchor:
    """The anchor whose ARK signed itself and its ASK, which signed this VCEK; `chain` error if none.

    Only the anchor's own ASK is an intermediate: a certificate the server sends is never one, so a
    VLEK (signed by AMD's ASVK) or a leaf under any other key of the ARK cannot stand in for a VCEK.
    """
    now = now or datetime.datetime.now(datetime.UTC)
    for anchor in anchors:
        if vcek.issuer != anchor.ask.subject:
            continue
        for cert, issuer, role in ((anchor.ark, anchor.ark, "ARK"), (anchor.ask, anchor.ark, "ASK"),
                                   (vcek, anchor.ask, "VCEK")):
            _check_certificate(cert, issuer, role, now)
        return anchor
    names = ", ".join(("amd-" if a.pinned else "simulated ") + a.product for a in anchors)
    raise AttestationError("chain",
                           f"the VCEK is issued by {vcek.issuer.rfc4514_string()}, not by the ASK of a trusted "
                                    f"root ({names}); VLEKs, issued by AMD's ASVK, are not accepted")


def verify_report_form(report: SnpReport) -> None:
    """What says how to read the rest: a report version AMD defines, a VCEK as the signer, a guest
    policy and signer info without reserved bits set."""
    if report.version not in REPORT_VERSIONS:
        raise AttestationError("report", f"report version {report.version}: this verifier reads versions "
                                         f"{REPORT_VERSIONS[0]} to {REPORT_VERSIONS[-1]}")
    if report.signer_info & ~SIGNER_INFO_DEFINED:
        raise AttestationError("report", f"the signer info {report.signer_info:#x} sets reserved bits")
    if report.signing_key != SIGNING_KEY_VCEK:
        name = "a VLEK" if report.signing_key == SIGNING_KEY_VLEK else f"signing key {report.signing_key}"
        raise AttestationError("report",
                               f"the report is signed by {name}; this verifier accepts VCEK-signed reports only")
    if report.policy & ~POLICY_DEFINED or not report.policy & POLICY_RESERVED_ONE:
        raise AttestationError("report", f"the guest policy {report.policy:#x} is malformed (reserved bits)")


def verify_guest(report: SnpReport, policy: AttestationPolicy) -> None:
    """What the guest may do: report from VMPL 0, no debugging, no migration agent, unless the policy allows."""
    if report.vmpl != 0:
        raise AttestationError("vmpl", f"the report was requested at VMPL {report.vmpl}, not 0: under an SVSM or "
                                       f"paravisor, unmeasured software there can ask for reports with any report_data")
    if report.debug and not policy.allow_debug:
        raise AttestationError("debug", "the guest runs with debugging on: its host can read its memory")
    if report.migration_agent and not policy.allow_migration_agent:
        raise AttestationError("migration", "the guest policy allows a migration agent, which can export the guest's "
                                            "memory; the policy does not allow one")


def verify_report_signature(report: SnpReport, vcek: x509.Certificate) -> None:
    """The report's ECDSA P-384 / SHA-384 signature by the VCEK over its first 0x2A0 bytes."""
    if report.signature_algo != SIGNATURE_ECDSA_P384_SHA384:
        raise AttestationError("signature", f"unknown signature algorithm {report.signature_algo}")
    key = vcek.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP384R1):
        raise AttestationError("signature", "the VCEK is not an ECDSA P-384 key")
    try:
        key.verify(encode_dss_signature(*report.signature()), report.signed, ec.ECDSA(hashes.SHA384()))
    except InvalidSignature:
        raise AttestationError("signature", "the report's signature does not verify under the VCEK") from None


def _extension(cert: x509.Certificate, oid: str) -> bytes | None:
    try:
        return cert.extensions.get_extension_for_oid(x509.ObjectIdentifier(oid)).value.value  # type: ignore[attr-defined]
    except x509.ExtensionNotFound:
        return None
    except ValueError as exc:  # a malformed or repeated extension
        raise AttestationError("vcek", f"the VCEK's extensions cannot be read ({exc})") from None


def _der_level(raw: bytes, name: str) -> int:
    """AMD's SPL extensions hold a DER INTEGER (02 len value), a level 0-255: one byte below 128, else a
    zero byte and the level."""
    body = raw[2:]
    minimal = (len(body) == 1 and body[0] < 0x80) or (len(body) == 2 and body[0] == 0 and body[1] >= 0x80)
    if raw[:1] != b"\x02" or len(raw) < 3 or raw[1] != len(body) or not minimal:
        raise AttestationError("vcek", f"the VCEK's {name} level is not a DER integer 0-255")
    return body[-1]


def verify_vcek_binding(report: SnpReport, vcek: x509.Certificate, product: str) -> None:
    """A VCEK is derived for one chip at one TCB: it must name both, and both must be the report's.

    The hwID is as long as AMD's key service makes it for the product (the whole chip_id, or its first
    8 bytes on Turin), and the TCB is read in the product's layout.
    """
    size = HWID_SIZE[product]
    hwid = _extension(vcek, HWID_OID)
    if hwid is None:
        raise AttestationError("vcek", "the VCEK names no chip (no hwID extension)")
    if len(hwid) == size + 2 and hwid[:2] == bytes([0x04, size]):  # an OCTET STRING, where AMD stores the bare bytes
        hwid = hwid[2:]
    if len(hwid) != size:
        raise AttestationError("vcek", f"the VCEK's hwID is {len(hwid)} bytes; a {product} VCEK's is {size}")
    if hwid != report.chip_id[:size]:
        raise AttestationError("vcek", "the VCEK belongs to another chip than the report's")
    reported = Tcb.parse(report.reported_tcb, product)
    for name in TCB_FIELDS[product]:
        raw = _extension(vcek, SPL_OIDS[name])
        if raw is None:
            raise AttestationError("vcek", f"the VCEK names no {name} level")
        level = _der_level(raw, name)
        if level != getattr(reported, name):
            raise AttestationError("vcek", f"the VCEK was issued for {name} level {level}, the report's is "
                                           f"{getattr(reported, name)}")


def verify_evidence(
    report: SnpReport,
    vcek: x509.Certificate,
    policy: AttestationPolicy,
    expected_report_data: bytes,
    now: datetime.datetime | None = None,
) -> Verified:
    """Every check of a report, in order: its form and the guest's settings, chain, signature, VCEK
    binding, handshake binding, then the policy's fields. The caller checks what the binding covers
    (model, split) against its own."""
    verify_report_form(report)
    verify_guest(report, policy)
    anchor = verify_chain(vcek, policy.anchors, now)
    verify_report_signature(report, vcek)
    verify_vcek_binding(report, vcek, anchor.product)
    if report.report_data != expected_report_data:
        raise AttestationError(
            "binding", "the report was not made for this handshake (its report_data does not match the nonce and "
                       "the server's key): replayed, or relayed under another key"
        )
    if report.measurement not in policy.measurements:
        raise AttestationError("measurement", f"the server's launch measurement {report.measurement.hex()} is not in "
                                              f"the policy's list")
    low = Tcb.parse(report.reported_tcb, anchor.product).below(policy.min_tcb[anchor.product])
    if low:
        raise AttestationError("tcb", f"the platform's TCB is below the {anchor.product} minimum in {', '.join(low)} "
                                      f"(firmware with known flaws)")
    if policy.host_data is not None and report.host_data not in policy.host_data:
        raise AttestationError("host_data", f"host data {report.host_data.hex()} is not in the policy's list")
    if policy.image_ids is not None and report.image_id not in policy.image_ids:
        raise AttestationError("image_id", f"image id {report.image_id.hex()} is not in the policy's list")
    return Verified(report, anchor.product, not anchor.pinned)
