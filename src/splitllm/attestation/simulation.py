"""A simulated SEV-SNP vendor and guest, for tests and development on machines without SNP.

`sim_init(folder)` writes a vendor chain made with AMD's algorithms and roles (an RSA-4096 ARK and ASK,
certificate authorities signing with RSA-PSS / SHA-384, an ECDSA P-384 VCEK carrying AMD's TCB and
chip extensions as AMD lays them out for the product), a launch measurement, and `policy.json`
trusting exactly them, marked `"simulated": true`; the guest runs at the product's TCB floor. `SimulatedSnp`
then signs byte-exact SNP reports with that VCEK. The client verifies them with the same code as
genuine evidence; only the trust anchor differs, and a simulated one protects nothing: whoever holds
the folder can sign any report.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.x509.oid import NameOID

from splitllm.attestation.policy import TCB_FLOORS
from splitllm.attestation.snp import (
    HWID_OID, HWID_SIZE, POLICY_DEBUG, POLICY_RESERVED_ONE, SIGNATURE_ECDSA_P384_SHA384, SIGNED_SIZE, SPL_OIDS,
    TCB_FIELDS, Tcb, pack_report,
)

_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA384()), salt_length=48)
GUEST_POLICY = (1 << 16) | POLICY_RESERVED_ONE  # SMT allowed, the reserved bit that must be set; debugging off


@dataclass(frozen=True)
class SimulatedGuest:
    """What the simulated guest reports (attester.json): its product line, launch and platform state."""

    product: str
    measurement: str
    chip_id: str
    tcb: dict[str, int]
    guest_policy: int = GUEST_POLICY
    host_data: str = "00" * 32
    image_id: str = "00" * 16


def _name(cn: str) -> x509.Name:
    return x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "Engineering"),
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "splitllm simulated vendor (protects nothing)"),
        x509.NameAttribute(NameOID.COMMON_NAME, cn),
    ])


def _certificate(
    subject: str, issuer: str, key: object, signer: object, extensions: dict[str, bytes] | None = None, ca: bool = False
) -> x509.Certificate:
    """One certificate as AMD issues them; `ca` makes it a certificate authority (ARK, ASK)."""
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject)).issuer_name(_name(issuer))
        .public_key(key.public_key())  # type: ignore[attr-defined]
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=3650))
    )
    if ca:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).add_extension(
            x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                          encipher_only=False, decipher_only=False),
            critical=True,
        )
    for oid, value in (extensions or {}).items():
        builder = builder.add_extension(x509.UnrecognizedExtension(x509.ObjectIdentifier(oid), value), critical=False)
    return builder.sign(signer, hashes.SHA384(), rsa_padding=_PSS)  # type: ignore[arg-type]


def _der_int(value: int) -> bytes:
    body = value.to_bytes(max(1, (value.bit_length() + 8) // 8), "big")
    return bytes([0x02, len(body)]) + body


def sim_init(folder: str | os.PathLike, product: str = "milan", debug: bool = False, tcb: Tcb | None = None) -> Path:
    """Write a simulated vendor chain, a guest and `policy.json` that trusts them; returns the policy's path.

    `debug` launches the simulated guest with debugging allowed (a policy refuses it by default); `tcb`
    replaces the product's floor as the platform's TCB.
    """
    tcb = tcb or TCB_FLOORS[product]
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    title = product.capitalize()
    ark_key = rsa.generate_private_key(65537, 4096)
    ask_key = rsa.generate_private_key(65537, 4096)
    vcek_key = ec.generate_private_key(ec.SECP384R1())
    hwid = os.urandom(HWID_SIZE[product])
    chip_id = hwid.ljust(64, b"\x00")  # a Turin chip_id is its 8-byte hwID, then zeros
    extensions = {SPL_OIDS[name]: _der_int(getattr(tcb, name)) for name in TCB_FIELDS[product]}
    extensions[HWID_OID] = hwid  # the bare bytes, as AMD's key service stores them
    ark = _certificate(f"ARK-{title}", f"ARK-{title}", ark_key, ark_key, ca=True)
    ask = _certificate(f"SEV-{title}", f"ARK-{title}", ask_key, ark_key, ca=True)
    vcek = _certificate("SEV-VCEK", f"SEV-{title}", vcek_key, ask_key, extensions)
    for name, cert in (("ark", ark), ("ask", ask), ("vcek", vcek)):
        (out / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (out / "vcek.key").write_bytes(vcek_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ))
    (out / "vcek.key").chmod(0o600)
    guest = SimulatedGuest(
        product, os.urandom(48).hex(), chip_id.hex(), asdict(tcb), GUEST_POLICY | (POLICY_DEBUG if debug else 0)
    )
    (out / "attester.json").write_text(json.dumps(asdict(guest), indent=2) + "\n")
    policy = {
        "platform": "sev-snp",
        "simulated": True,
        "trust_anchors": [{"product": product, "ark": "ark.pem", "ask": "ask.pem"}],
        "measurements": [guest.measurement],
        "allow_debug": False,
    }
    path = out / "policy.json"
    path.write_text(json.dumps(policy, indent=2) + "\n")
    return path


class SimulatedSnp:
    """Signs SNP-format reports with a simulated VCEK (`serve --attestation simulated --attestation-sim DIR`)."""

    platform = "sev-snp"

    def __init__(self, folder: str | os.PathLike) -> None:
        folder = Path(folder)
        try:
            self.guest = SimulatedGuest(**json.loads((folder / "attester.json").read_text()))
            key = serialization.load_pem_private_key((folder / "vcek.key").read_bytes(), None)
            self.certs = {
                name: x509.load_pem_x509_certificate((folder / f"{name}.pem").read_bytes()).public_bytes(
                    serialization.Encoding.DER)
                for name in ("vcek", "ask", "ark")
            }
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(
                f"--attestation-sim {folder}: not a folder from `splitllm attest sim-init` ({exc})"
            ) from None
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"--attestation-sim {folder}: vcek.key is not an ECDSA key")
        self._key = key

    def report(self, report_data: bytes) -> tuple[bytes, dict[str, bytes]]:
        g = self.guest
        tcb = Tcb(**g.tcb).pack(g.product)
        fields: dict[str, Any] = dict(
            version=2, guest_svn=0, policy=g.guest_policy, image_id=bytes.fromhex(g.image_id), vmpl=0,
            signature_algo=SIGNATURE_ECDSA_P384_SHA384, current_tcb=tcb, platform_info=1, report_data=report_data,
            measurement=bytes.fromhex(g.measurement), host_data=bytes.fromhex(g.host_data), report_id=os.urandom(32),
            reported_tcb=tcb, chip_id=bytes.fromhex(g.chip_id),
        )
        signed = pack_report(**fields)[:SIGNED_SIZE]
        signature = decode_dss_signature(self._key.sign(signed, ec.ECDSA(hashes.SHA384())))
        return pack_report(signature, **fields), dict(self.certs)
