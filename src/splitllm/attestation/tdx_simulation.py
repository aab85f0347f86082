"""A simulated Intel DCAP vendor and TDX guest, for tests and development on machines without TDX.

`tdx_sim_init(folder)` writes a vendor made with Intel's algorithms and certificate profile (an ECDSA
P-256 root, a PCK Platform CA, a PCK certificate carrying Intel's SGX extension, a TCB signing
certificate), a TD's measurements, and `policy.json` trusting exactly them, marked `"simulated": true`.
`SimulatedTdx` then makes byte-exact quotes of version 4 (a TD report signed by an attestation key
that a QE report, signed by the PCK key, binds) with fresh collateral: CRLs, TCB info and QE identity
signed by the TCB signing key. The client verifies them with the same code as genuine evidence (the
same dcap-qvl verification, under the simulated root); only the root differs, and a simulated root
protects nothing: whoever holds the folder can sign any quote.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.x509.oid import NameOID

from splitllm.attestation.tdx import COLLATERAL, PLATFORM, QUOTE_VERSION, TEE_TYPE_TDX

_SGX = "1.2.840.113741.1.13.1"  # Intel's SGX extension of a PCK certificate
_INTEL_QE_VENDOR = bytes.fromhex("939a7233f79c4ca9940a0db3957f0607")
_ECDSA_P256 = 2  # the quote's attestation key type
_QE_REPORT_CERTIFICATION = 6  # certification data: the QE report, its signature, auth data, then the PCK chain
_PCK_CHAIN_CERTIFICATION = 5
# The simulated platform: its FMSPC, CPU SVN, PCE SVN and TD module SVNs (as a genuine Sapphire Rapids host).
_FMSPC = bytes.fromhex("00906ED50000")
_CPU_SVN = bytes([3, 3, 2, 2, 4, 1, 0, 5] + [0] * 8)
_PCE_SVN = 13
_TEE_TCB_SVN = bytes([6, 1, 3] + [0] * 13)  # TDX module 1 (the second byte), SVN 6
_QE_MRSIGNER = bytes.fromhex("dc9e2a7c6f948f17474e34a7fc43ed030f7c1563f1babddf6340c82e0e54a8c5")
_QE_PROD_ID, _QE_SVN = 2, 4
_QE_ATTRIBUTES = bytes.fromhex("1500000000000000e700000000000000")  # initialised, 64-bit, provisioning key; no debug
_TD_ATTRIBUTES = bytes.fromhex("0000001000000000")  # SEPT_VE_DISABLE; no debug
_TD_DEBUG = 0x01  # td_attributes[0] bit 0: the host may read the TD's memory
_KEYS = ("root", "pck_ca", "pck", "tcb")


def _der(tag: int, body: bytes) -> bytes:
    size = len(body)
    if size < 0x80:
        return bytes([tag, size]) + body
    octets = (size.bit_length() + 7) // 8
    return bytes([tag, 0x80 | octets]) + size.to_bytes(octets, "big") + body


def _oid(dotted: str) -> bytes:
    arcs = [int(a) for a in dotted.split(".")]
    body = bytes([40 * arcs[0] + arcs[1]])
    for arc in arcs[2:]:
        chunk = [arc & 0x7F]
        while arc > 0x7F:
            arc >>= 7
            chunk.insert(0, 0x80 | (arc & 0x7F))
        body += bytes(chunk)
    return _der(0x06, body)


def _entry(oid: str, value: bytes) -> bytes:
    return _der(0x30, _oid(oid) + value)


def _integer(value: int) -> bytes:
    return _der(0x02, value.to_bytes(value.bit_length() // 8 + 1, "big"))


def _sgx_extension(ppid: bytes) -> bytes:
    """Intel's SGX extension (OID 1.2.840.113741.1.13.1): PPID, TCB (16 CPU SVN components, PCE SVN, CPU
    SVN), PCE ID, FMSPC and SGX type, as a PCK certificate carries them."""
    tcb = b"".join(_entry(f"{_SGX}.2.{i + 1}", _integer(svn)) for i, svn in enumerate(_CPU_SVN))
    tcb += _entry(f"{_SGX}.2.17", _integer(_PCE_SVN)) + _entry(f"{_SGX}.2.18", _der(0x04, _CPU_SVN))
    return _der(0x30, _entry(f"{_SGX}.1", _der(0x04, ppid)) + _entry(f"{_SGX}.2", _der(0x30, tcb))
                + _entry(f"{_SGX}.3", _der(0x04, bytes(2))) + _entry(f"{_SGX}.4", _der(0x04, _FMSPC))
                + _entry(f"{_SGX}.5", _der(0x0A, b"\x01")))


def _name(cn: str) -> x509.Name:
    return x509.Name([
        x509.NameAttribute(NameOID.COMMON_NAME, cn),
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "splitllm simulated vendor (protects nothing)"),
    ])


def _certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: str, signer: ec.EllipticCurvePrivateKey,
                 ca: bool, extension: bytes | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject)).issuer_name(_name(issuer)).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=not ca, content_commitment=not ca, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=ca, crl_sign=ca,
                                     encipher_only=False, decipher_only=False), critical=True)
    )
    if extension is not None:
        builder = builder.add_extension(x509.UnrecognizedExtension(x509.ObjectIdentifier(_SGX), extension),
                                        critical=False)
    return builder.sign(signer, hashes.SHA256())


@dataclass(frozen=True)
class SimulatedTd:
    """What the simulated TD reports (attester.json): its measurements and its platform's TCB status."""

    mrtd: str
    rtmr0: str
    rtmr1: str
    rtmr2: str
    rtmr3: str = "00" * 48
    mr_config_id: str = "00" * 48
    tcb_status: str = "UpToDate"  # what the simulated TCB info says of this platform
    debug: bool = False
    platform: str = PLATFORM


def tdx_sim_init(folder: str | os.PathLike, tcb_status: str = "UpToDate", debug: bool = False) -> Path:
    """Write a simulated Intel vendor, a TD and `policy.json` that trusts them; returns the policy's path.

    `tcb_status` is the status the vendor's TCB info gives the platform (a policy accepts UpToDate
    only by default); `debug` launches the TD with debugging on (always refused)."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    keys = {name: ec.generate_private_key(ec.SECP256R1()) for name in _KEYS}
    root = _certificate("Simulated SGX Root CA", keys["root"], "Simulated SGX Root CA", keys["root"], ca=True)
    certs = {
        "root": root,
        "pck_ca": _certificate("Simulated SGX PCK Platform CA", keys["pck_ca"], "Simulated SGX Root CA", keys["root"],
                               ca=True),
        "pck": _certificate("Simulated SGX PCK Certificate", keys["pck"], "Simulated SGX PCK Platform CA",
                            keys["pck_ca"], ca=False, extension=_sgx_extension(os.urandom(16))),
        "tcb": _certificate("Simulated SGX TCB Signing", keys["tcb"], "Simulated SGX Root CA", keys["root"], ca=False),
    }
    for name in _KEYS:
        (out / f"{name}.pem").write_bytes(certs[name].public_bytes(serialization.Encoding.PEM))
        key = out / f"{name}.key"
        key.write_bytes(keys[name].private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption()))
        key.chmod(0o600)
    mrtd, rtmr0, rtmr1, rtmr2 = (os.urandom(48).hex() for _ in range(4))
    td = SimulatedTd(mrtd, rtmr0, rtmr1, rtmr2, tcb_status=tcb_status, debug=debug)
    (out / "attester.json").write_text(json.dumps(asdict(td), indent=2) + "\n")
    policy = {
        "platform": PLATFORM,
        "simulated": True,
        "tdx": {
            "trust_anchor": {"root": "root.pem"},
            "measurements": [{"mrtd": td.mrtd, "rtmr0": td.rtmr0, "rtmr1": td.rtmr1, "rtmr2": td.rtmr2}],
        },
    }
    path = out / "policy.json"
    path.write_text(json.dumps(policy, indent=2) + "\n")
    return path


def is_tdx_simulation(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds a simulated TDX vendor (else it is an SEV-SNP one, or nothing)."""
    try:
        return json.loads((Path(folder) / "attester.json").read_text()).get("platform") == PLATFORM
    except (OSError, ValueError, AttributeError):
        return False


def _raw_signature(key: ec.EllipticCurvePrivateKey, data: bytes) -> bytes:
    """ECDSA P-256 / SHA-256 as DCAP stores it: r and s, 32 big-endian bytes each."""
    r, s = decode_dss_signature(key.sign(data, ec.ECDSA(hashes.SHA256())))
    return r.to_bytes(32, "big") + s.to_bytes(32, "big")


def _when(moment: datetime.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


class SimulatedTdx:
    """Makes TDX quotes and their collateral with a simulated vendor (`serve --attestation simulated
    --attestation-sim DIR` with a folder from `tdx_sim_init`)."""

    platform = PLATFORM

    def __init__(self, folder: str | os.PathLike) -> None:
        folder = Path(folder)
        try:
            self.td = SimulatedTd(**json.loads((folder / "attester.json").read_text()))
            self.certs = {name: x509.load_pem_x509_certificate((folder / f"{name}.pem").read_bytes()) for name in _KEYS}
            keys = {name: serialization.load_pem_private_key((folder / f"{name}.key").read_bytes(),
                                                             None) for name in _KEYS}
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"--attestation-sim {folder}: not a folder from tdx_sim_init ({exc})") from None
        if not all(isinstance(k, ec.EllipticCurvePrivateKey) for k in keys.values()):
            raise ValueError(f"--attestation-sim {folder}: its keys are not ECDSA keys")
        self._keys: dict[str, ec.EllipticCurvePrivateKey] = keys  # type: ignore[assignment]
        self._attestation_key = ec.generate_private_key(ec.SECP256R1())  # the QE's, made when it starts

    def _pem(self, *names: str) -> bytes:
        return b"".join(self.certs[n].public_bytes(serialization.Encoding.PEM) for n in names)

    def quote(self, report_data: bytes) -> bytes:
        """A quote of version 4 whose TD report carries `report_data`."""
        td = self.td
        header = struct.pack("<HHIHH16s20s", QUOTE_VERSION, _ECDSA_P256, TEE_TYPE_TDX, 0, 0, _INTEL_QE_VENDOR,
                             bytes(20))
        attributes = bytes([_TD_ATTRIBUTES[0] | (_TD_DEBUG if td.debug else 0)]) + _TD_ATTRIBUTES[1:]
        body = (_TEE_TCB_SVN + bytes(48) + bytes(48) + bytes(8) + attributes + bytes.fromhex("e702060000000000")
                + bytes.fromhex(td.mrtd) + bytes.fromhex(td.mr_config_id) + bytes(48) + bytes(48)
                + b"".join(bytes.fromhex(r) for r in (td.rtmr0, td.rtmr1, td.rtmr2, td.rtmr3)) + report_data)
        numbers = self._attestation_key.public_key().public_numbers()
        attestation_key = numbers.x.to_bytes(32, "big") + numbers.y.to_bytes(32, "big")
        auth_data = os.urandom(32)
        qe_report = (_CPU_SVN + struct.pack("<I",
                                            0) + bytes(28) + _QE_ATTRIBUTES + hashlib.sha256(b"simulated QE").digest()
                     + bytes(32) + _QE_MRSIGNER + bytes(96) + struct.pack("<HH", _QE_PROD_ID, _QE_SVN) + bytes(60)
                     + hashlib.sha256(attestation_key + auth_data).digest() + bytes(32))
        chain = self._pem("pck", "pck_ca", "root")
        certification = (qe_report + _raw_signature(self._keys["pck"], qe_report) + struct.pack("<H", len(auth_data))
                         + auth_data + struct.pack("<HI", _PCK_CHAIN_CERTIFICATION, len(chain)) + chain)
        signed = (_raw_signature(self._attestation_key, header + body) + attestation_key
                  + struct.pack("<HI", _QE_REPORT_CERTIFICATION, len(certification)) + certification)
        return header + body + struct.pack("<I", len(signed)) + signed

    def collateral(self) -> bytes:
        """CRLs, TCB info and QE identity as Intel's PCS would issue them now, in dcap-qvl's JSON layout."""
        now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
        issued, expires = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=30)
        tcb_level = {"tcb": {"sgxtcbcomponents": [{"svn": s} for s in _CPU_SVN], "pcesvn": _PCE_SVN,
                             "tdxtcbcomponents": [{"svn": s} for s in _TEE_TCB_SVN]},
                     "tcbDate": _when(issued), "tcbStatus": self.td.tcb_status}
        module = {"mrsigner": "00" * 48, "attributes": "00" * 8, "attributesMask": "FF" * 8}
        tcb_info = json.dumps({
            "id": "TDX", "version": 3, "issueDate": _when(issued), "nextUpdate": _when(expires),
            "fmspc": _FMSPC.hex().upper(),
            "pceId": "0000", "tcbType": 0, "tcbEvaluationDataNumber": 17, "tdxModule": module,
            "tdxModuleIdentities": [{"id": f"TDX_{_TEE_TCB_SVN[1]:02X}", **module, "tcbLevels": [
                {"tcb": {"isvsvn": _TEE_TCB_SVN[0]}, "tcbDate": _when(issued), "tcbStatus": "UpToDate"}]}],
            "tcbLevels": [tcb_level],
        }, separators=(",", ":"))
        qe_identity = json.dumps({
            "id": "TD_QE", "version": 2, "issueDate": _when(issued), "nextUpdate": _when(expires),
            "tcbEvaluationDataNumber": 17, "miscselect": "00000000", "miscselectMask": "FFFFFFFF",
            "attributes": "11" + "00" * 15, "attributesMask": "FBFFFFFFFFFFFFFF" + "00" * 8,
            "mrsigner": _QE_MRSIGNER.hex().upper(),
            "isvprodid": _QE_PROD_ID,
            "tcbLevels": [{"tcb": {"isvsvn": _QE_SVN}, "tcbDate": _when(issued), "tcbStatus": "UpToDate"}],
        }, separators=(",", ":"))
        tcb_chain = self._pem("tcb", "root").decode()
        return json.dumps({
            "pck_crl_issuer_chain": self._pem("pck_ca", "root").decode(),
            "root_ca_crl": self._crl("root", issued, expires).hex(),
            "pck_crl": self._crl("pck_ca", issued, expires).hex(),
            "tcb_info_issuer_chain": tcb_chain, "tcb_info": tcb_info,
            "tcb_info_signature": _raw_signature(self._keys["tcb"], tcb_info.encode()).hex(),
            "qe_identity_issuer_chain": tcb_chain, "qe_identity": qe_identity,
            "qe_identity_signature": _raw_signature(self._keys["tcb"], qe_identity.encode()).hex(),
        }).encode()

    def _crl(self, issuer: str, issued: datetime.datetime, expires: datetime.datetime) -> bytes:
        crl = (
            x509.CertificateRevocationListBuilder()
            .issuer_name(self.certs[issuer].subject).last_update(issued).next_update(expires)
            .add_extension(x509.CRLNumber(1), critical=False)
            .sign(self._keys[issuer], hashes.SHA256())
        )
        return crl.public_bytes(serialization.Encoding.DER)

    def report(self, report_data: bytes) -> tuple[bytes, dict[str, bytes]]:
        return self.quote(report_data), {COLLATERAL: self.collateral()}
