"""Checking SEV-SNP evidence against a policy: the vendor chain, the report's signature, its binding to
this handshake, and every field the policy bounds. The first check that fails raises one
`AttestationError` naming it; genuine and simulated evidence go through the same code.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from splitllm.attestation.policy import Anchor, AttestationPolicy
from splitllm.attestation.snp import SIGNATURE_ECDSA_P384_SHA384, SnpReport, Tcb

# AMD's X.509 extensions in a VCEK: the TCB it was derived for, and the chip it belongs to.
_AMD = "1.3.6.1.4.1.3704.1"
_SPL_OIDS = {"bootloader": f"{_AMD}.3.1", "tee": f"{_AMD}.3.2", "snp": f"{_AMD}.3.3", "microcode": f"{_AMD}.3.8",
             "fmc": f"{_AMD}.3.9"}
_HWID_OID = f"{_AMD}.4"


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


def _signed_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    """Whether `issuer`'s key signed `cert` (AMD signs with RSA-PSS; cryptography reads its parameters)."""
    key = issuer.public_key()
    try:
        if isinstance(key, rsa.RSAPublicKey):
            padding = cert.signature_algorithm_parameters
            key.verify(cert.signature, cert.tbs_certificate_bytes, padding, cert.signature_hash_algorithm)  # type: ignore[arg-type]
        elif isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(cert.signature_hash_algorithm))  # type: ignore[arg-type]
        else:
            return False
    except (InvalidSignature, ValueError, TypeError):
        return False
    return cert.issuer == issuer.subject


def _current(cert: x509.Certificate, now: datetime.datetime, role: str) -> None:
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise AttestationError("chain", f"the {role} certificate is not valid now ({cert.not_valid_before_utc:%Y-%m-%d} "
                                        f"to {cert.not_valid_after_utc:%Y-%m-%d})")


def verify_chain(
    vcek: x509.Certificate, ask: x509.Certificate | None, anchors: tuple[Anchor, ...], now: datetime.datetime | None = None
) -> Anchor:
    """The anchor whose ARK signed an ASK that signed this VCEK (the ARK signs itself); `chain` error if none."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    for anchor in anchors:
        signer = anchor.ask if anchor.ask is not None and vcek.issuer == anchor.ask.subject else ask
        if signer is None or vcek.issuer != signer.subject:
            continue
        if not (_signed_by(anchor.ark, anchor.ark) and _signed_by(signer, anchor.ark) and _signed_by(vcek, signer)):
            continue
        for cert, role in ((anchor.ark, "ARK"), (signer, "ASK"), (vcek, "VCEK")):
            _current(cert, now, role)
        return anchor
    names = ", ".join(("amd-" if a.pinned else "simulated ") + a.product for a in anchors)
    raise AttestationError("chain", f"the VCEK ({vcek.issuer.rfc4514_string()}) does not chain to a trusted root ({names})")


def verify_report_signature(report: SnpReport, vcek: x509.Certificate) -> None:
    """The report's ECDSA P-384 / SHA-384 signature by the VCEK over its first 0x2A0 bytes."""
    if report.signature_algo != SIGNATURE_ECDSA_P384_SHA384:
        raise AttestationError("signature", f"unknown signature algorithm {report.signature_algo}")
    key = vcek.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp384r1":
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


def _der_int(raw: bytes) -> int:
    """AMD's SPL extensions hold a DER INTEGER (02 len value)."""
    if len(raw) < 3 or raw[0] != 0x02 or raw[1] != len(raw) - 2:
        raise AttestationError("vcek", "a TCB extension of the VCEK is not a DER integer")
    return int.from_bytes(raw[2:], "big")


def verify_vcek_binding(report: SnpReport, vcek: x509.Certificate, product: str) -> None:
    """A VCEK is derived for one chip at one TCB: both must be the report's (a VLEK has neither)."""
    hwid = _extension(vcek, _HWID_OID)
    if hwid is not None:
        hwid = hwid[2:] if hwid[:1] == b"\x04" and len(hwid) == len(report.chip_id) + 2 else hwid
        if hwid != report.chip_id:
            raise AttestationError("vcek", "the VCEK belongs to another chip than the report's")
    reported = Tcb.parse(report.reported_tcb, product)
    for name, oid in _SPL_OIDS.items():
        raw = _extension(vcek, oid)
        if raw is not None and _der_int(raw) != getattr(reported, name):
            raise AttestationError("vcek", f"the VCEK was issued for {name} level {_der_int(raw)}, the report's is "
                                           f"{getattr(reported, name)}")


def verify_evidence(
    report: SnpReport,
    vcek: x509.Certificate,
    ask: x509.Certificate | None,
    policy: AttestationPolicy,
    expected_report_data: bytes,
    now: datetime.datetime | None = None,
) -> Verified:
    """Every check of a report, in order: chain, signature, VCEK binding, handshake binding, then the
    policy's fields. The caller checks what the binding covers (model, split) against its own."""
    anchor = verify_chain(vcek, ask, policy.anchors, now)
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
    if report.debug and not policy.allow_debug:
        raise AttestationError("debug", "the guest runs with debugging on: its host can read its memory")
    if policy.min_tcb is not None:
        low = Tcb.parse(report.reported_tcb, anchor.product).below(policy.min_tcb)
        if low:
            raise AttestationError("tcb", f"the platform's TCB is below the policy's minimum in {', '.join(low)}")
    if policy.host_data is not None and report.host_data not in policy.host_data:
        raise AttestationError("host_data", f"host data {report.host_data.hex()} is not in the policy's list")
    if policy.image_ids is not None and report.image_id not in policy.image_ids:
        raise AttestationError("image_id", f"image id {report.image_id.hex()} is not in the policy's list")
    return Verified(report, anchor.product, not anchor.pinned)
