"""NVIDIA GPU evidence without a GPU: genuine H100 and Blackwell reports verify against NVIDIA's pinned
root, each tampered copy is refused by one named check, and the CVM's report must commit to the GPU
evidence it presents."""

from __future__ import annotations

import base64
import dataclasses
import datetime
import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.x509.oid import NameOID

from splitllm.attestation.gpu import (
    REQUEST_SIZE, GpuEvidence, GpuPolicy, GpuReport, finish_with_gpus, gpu_evidence_digest,
    nvidia_root, verify_gpu_chain, verify_gpu_evidence, verify_gpu_report_signature,
)
from splitllm.attestation.handshake import ClientHandshake, Evidence, _raw, composite_report_data, report_data
from splitllm.attestation.policy import AttestationPolicy
from splitllm.attestation.simulation import SimulatedSnp
from splitllm.attestation.tdx import TdxVerified
from splitllm.attestation.tdx_simulation import SimulatedTdx, tdx_sim_init
from splitllm.attestation.verify import AttestationError

DATA = Path(__file__).parent / "data" / "nvidia"
WHEN = datetime.datetime(2026, 6, 1, tzinfo=datetime.UTC)  # inside every certificate's validity
BLACKWELL_NONCE = bytes.fromhex("931d8dd0add203ac3d8b4fbde75e115278eefcdceac5b87671a748f32364dfcb")
FINGERPRINT = "ab" * 32
WEIGHTS = "5e" * 32
LAYERS = (2, 28)
VERSION = 2
RECORD = REQUEST_SIZE + 8  # where the first measurement block starts
BLOCK = 4 + 3 + 48  # index, specification, size; then type, size and a SHA-384 value


@cache
def hopper() -> tuple[tuple[GpuEvidence, ...], bytes]:
    """Eight H100s' evidence as NVIDIA's driver returned it, and the nonce they all answer."""
    entries = json.loads((DATA / "hopper_gpu_evidence.json").read_text())
    gpus = tuple(GpuEvidence(base64.b64decode(e["evidence"]), base64.b64decode(e["certificate"])) for e in entries)
    (nonce,) = {e["nonce"] for e in entries}
    return gpus, bytes.fromhex(nonce)


@cache
def blackwell() -> GpuEvidence:
    return GpuEvidence(bytes.fromhex((DATA / "blackwellAttestationReport.txt").read_text().strip()),
                       (DATA / "blackwellCertChain.txt").read_bytes())


def _refused(evidence: GpuEvidence, nonce: bytes, policy: GpuPolicy | None = None,
             when: datetime.datetime = WHEN) -> AttestationError:
    with pytest.raises(AttestationError) as err:
        verify_gpu_evidence(evidence, nonce, policy, when)
    assert "no hidden state was sent" in str(err.value)
    return err.value


def _pem(certs: list[x509.Certificate]) -> bytes:
    return b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certs)


def _flipped(raw: bytes, offset: int) -> bytes:
    out = bytearray(raw)
    out[offset] ^= 0x01
    return bytes(out)


def test_genuine_hopper_and_blackwell_evidence_verifies_against_nvidias_pinned_root() -> None:
    gpus, nonce = hopper()
    for gpu in gpus:
        verified = verify_gpu_evidence(gpu, nonce, now=WHEN)
        assert verified.report.nonce == nonce and verified.report.driver_version == "590.12"
        assert "GH100 A01 GSP FMC LF" in verified.certificate.subject.rfc4514_string()
        assert sorted(verified.report.measurements) == list(range(1, 65))
        assert {len(v) for v in verified.report.measurements.values()} == {48}  # SHA-384 digests
    assert len({verify_gpu_evidence(g, nonce, now=WHEN).certificate for g in gpus}) == 8  # eight distinct GPUs
    verified = verify_gpu_evidence(blackwell(), BLACKWELL_NONCE, now=WHEN)
    assert verified.report.driver_version == "575.32" and "GB100" in verified.certificate.subject.rfc4514_string()
    assert len(verified.report.measurements) == 64


def test_each_tampered_copy_is_refused_by_its_named_check() -> None:
    gpus, nonce = hopper()
    gpu, other = gpus[0], gpus[1]
    leaves = [x509.load_pem_x509_certificates(g.certificates) for g in (gpu, other)]
    measurement = RECORD + 5 * BLOCK + 7  # the first byte of block 6's value
    cases = [
        (_flipped(gpu.report, measurement), gpu.certificates, nonce, "gpu-signature", "does not verify"),
        (_flipped(gpu.report, len(gpu.report) - 1), gpu.certificates, nonce, "gpu-signature", "does not verify"),
        (_flipped(gpu.report, 4), gpu.certificates, nonce, "gpu-signature", "does not verify"),  # the nonce is signed
        (gpu.report, gpu.certificates, bytes(32), "gpu-nonce", "answers another nonce"),
        # another GPU's leaf
        (gpu.report, _pem([leaves[1][0], *leaves[0][1:]]), nonce, "gpu-chain", "was not issued by"),
        (gpu.report, other.certificates, nonce, "gpu-signature", "does not verify"),  # another GPU's whole chain
        (gpu.report, _pem(leaves[0][:-1]), nonce, "gpu-chain", "not at a pinned root"),  # the root left out
        (gpu.report, b"not a certificate", nonce, "gpu-chain", "does not parse"),
        (gpu.report[:-1], gpu.certificates, nonce, "gpu-evidence", "fields add up to"),
        (gpu.report + b"\x00", gpu.certificates, nonce, "gpu-evidence", "fields add up to"),
    ]
    for report, chain, expected_nonce, check, reason in cases:
        err = _refused(GpuEvidence(report, chain), expected_nonce)
        assert err.check == check and reason in str(err), (check, reason, str(err))
    before = datetime.datetime(2021, 1, 1, tzinfo=datetime.UTC)  # before NVIDIA's root was issued
    assert "not valid at 2021-01-01" in str(_refused(gpu, nonce, when=before))
    other_root = _ca("NVIDIA Device Identity CA", None, _key())[0]  # NVIDIA's name, someone else's key
    err = _refused(gpu, nonce, GpuPolicy(roots=(other_root,)))
    assert err.check == "gpu-chain" and "not at a pinned root" in str(err)
    forged = dataclasses.replace(gpu, certificates=_pem([*leaves[0][:-1], other_root]))
    assert "not at a pinned root" in str(_refused(forged, nonce))


def test_every_byte_of_the_genuine_report_is_covered() -> None:
    """A flip anywhere is refused: a field that no longer parses, or a signature that no longer verifies."""
    gpus, _ = hopper()
    raw = gpus[0].report
    leaf = verify_gpu_chain(gpus[0].certificates, (nvidia_root(),), WHEN)
    for offset in range(len(raw)):
        try:
            report = GpuReport.parse(_flipped(raw, offset))
        except ValueError:
            continue
        with pytest.raises(AttestationError, match=r"\(gpu-signature\)"):
            verify_gpu_report_signature(report, leaf)


@pytest.mark.parametrize(
    "offset, value, reason",
    [
        (0, 0x12, "not an SPDM 1.1 GET_MEASUREMENTS"),  # SPDM 1.2
        (2, 0x00, "not an SPDM 1.1 GET_MEASUREMENTS"),  # no signature requested
        (REQUEST_SIZE + 1, 0x61, "not an SPDM 1.1 MEASUREMENTS"),
        (REQUEST_SIZE + 4, 63, "announces 63 measurement blocks and holds 64"),
        (REQUEST_SIZE + 4, 0, "no measurement blocks"),
        (RECORD, 0, "reserved or repeated"),  # block index 0
        (RECORD + BLOCK, 1, "reserved or repeated"),  # block 2 renumbered 1
        (RECORD + 1, 0x02, "not a well-formed DMTF measurement"),  # another specification than DMTF's
        (RECORD + 5, 47, "not a well-formed DMTF measurement"),  # a value size that disagrees with the block's
    ],
)
def test_malformed_reports_are_refused_before_any_signature_check(offset: int, value: int, reason: str) -> None:
    gpus, nonce = hopper()
    raw = bytearray(gpus[0].report)
    raw[offset] = value
    err = _refused(GpuEvidence(bytes(raw), gpus[0].certificates), nonce)
    assert err.check == "gpu-evidence" and reason in str(err)


def test_golden_measurements_are_compared_by_index() -> None:
    gpus, nonce = hopper()
    measured = verify_gpu_evidence(gpus[0], nonce, now=WHEN).report.measurements
    golden = {i: frozenset({v}) for i, v in measured.items()}
    for gpu in gpus:  # the same firmware and driver on all eight: the same golden values
        verify_gpu_evidence(gpu, nonce, GpuPolicy(measurements=golden), WHEN)
    wrong = {**golden, 5: frozenset({bytes(48)})}
    err = _refused(gpus[0], nonce, GpuPolicy(measurements=wrong))
    assert err.check == "gpu-measurement" and f"measurement 5 ({measured[5].hex()})" in str(err)
    absent = {**golden, 65: frozenset({bytes(48)})}
    assert "measurement 65 (absent)" in str(_refused(gpus[0], nonce, GpuPolicy(measurements=absent)))
    verify_gpu_evidence(blackwell(), BLACKWELL_NONCE, GpuPolicy(measurements={}), WHEN)


# A certificate hierarchy of our own, to change one property at a time (a test root, never NVIDIA's).

def _key(curve: ec.EllipticCurve = ec.SECP384R1()) -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(curve)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _ca(cn: str, issuer: tuple[x509.Certificate, object] | None, key: object, *, ca: bool = True,
        path: int | None = None,
        usage: bool = True, hash_: hashes.HashAlgorithm = hashes.SHA384(), critical_extra: bool = False,
        rsa_padding: padding.AsymmetricPadding | None = None) -> tuple[x509.Certificate, object]:
    """A certificate for `key` (self-signed without `issuer`): a CA unless `ca` is False, with key usage to match."""
    issuer_name, signer = (issuer[0].subject, issuer[1]) if issuer else (_name(cn), key)
    builder = (
        x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(issuer_name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())  # type: ignore[attr-defined]
        .not_valid_before(WHEN - datetime.timedelta(days=1)).not_valid_after(WHEN + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=path if ca else None), critical=True)
    )
    if usage:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=not ca, content_commitment=False, key_encipherment=False, data_encipherment=False,
            key_agreement=False, key_cert_sign=ca, crl_sign=ca, encipher_only=False, decipher_only=False),
                                        critical=True)
    if critical_extra:
        builder = builder.add_extension(x509.UnrecognizedExtension(x509.ObjectIdentifier("1.3.6.1.4.1.99999.1"),
                                                                   b"\x05\x00"),
                                        critical=True)
    return builder.sign(signer, hash_, rsa_padding=rsa_padding), key  # type: ignore[arg-type]


def _chain(**change: Any) -> tuple[bytes, x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A root, an intermediate and an attestation-key leaf, with `change` applied to one of them by role."""
    root = _ca("test root", None, _key(), **change.get("root", {}))
    middle = _ca("test device", root, _key(), **change.get("middle", {}))
    leaf_key = change.get("leaf_key", _key())
    leaf = _ca("test attestation key", middle, leaf_key, **{"ca": False, **change.get("leaf", {})})
    return _pem([leaf[0], middle[0], root[0]]), root[0], leaf_key


def test_the_chain_pins_ecdsa_p384_sha384_and_each_certificates_role() -> None:
    pem, root, _ = _chain()
    verify_gpu_chain(pem, (root,), WHEN)  # the hierarchy as built is accepted: each case below changes one thing
    rsa_key = rsa.generate_private_key(65537, 2048)
    cases = [
        ({"leaf": {"hash_": hashes.SHA256()}}, "algorithm 1.2.840.10045.4.3.2"),  # ECDSA with SHA-256
        ({"leaf_key": _key(ec.SECP256R1())}, "does not hold an ECDSA P-384 key"),
        ({"middle": {"ca": False}}, "not a CA (basicConstraints)"),
        ({"leaf": {"ca": True}}, "is a CA certificate"),
        ({"root": {"path": 0}}, "allows 0 CAs below it; the chain has 1"),
        ({"middle": {"usage": False}}, "key usage does not allow it"),
        ({"leaf": {"critical_extra": True}}, "critical extensions this verifier does not know: 1.3.6.1.4.1.99999.1"),
    ]
    for change, reason in cases:
        pem, root, _ = _chain(**change)
        with pytest.raises(AttestationError, match=r"\(gpu-chain\)") as err:
            verify_gpu_chain(pem, (root,), WHEN)
        assert reason in str(err.value), reason
    # RSA PKCS#1 v1.5 with SHA-256, as much of the web's PKI signs: refused at the root already
    rsa_root = _ca("rsa root", None, rsa_key, hash_=hashes.SHA256(), rsa_padding=padding.PKCS1v15())
    rsa_leaf = _ca("rsa leaf", rsa_root, _key(), ca=False, hash_=hashes.SHA256(), rsa_padding=padding.PKCS1v15())
    pem = _pem([rsa_leaf[0], rsa_root[0]])
    with pytest.raises(AttestationError, match=r"\(gpu-chain\).*algorithm 1.2.840.113549.1.1.11"):
        verify_gpu_chain(pem, (rsa_root[0],), WHEN)


def test_a_report_signed_under_another_root_passes_only_where_that_root_is_trusted() -> None:
    """The whole chain and signature re-made with our keys over genuine content: only NVIDIA's pin refuses it."""
    gpus, nonce = hopper()
    report = GpuReport.parse(gpus[0].report)
    pem, root, leaf_key = _chain()
    r, s = decode_dss_signature(leaf_key.sign(report.signed, ec.ECDSA(hashes.SHA384())))
    forged = GpuEvidence(report.signed + r.to_bytes(48, "big") + s.to_bytes(48, "big"), pem)
    assert len(forged.report) == len(report.raw)
    verify_gpu_evidence(forged, nonce, GpuPolicy(roots=(root,)), WHEN)
    assert _refused(forged, nonce).check == "gpu-chain"


def _server_evidence(vendor: Path, nonce: bytes, bound: bytes | None, attester: Any = SimulatedSnp) -> Evidence:
    """A simulated CVM's evidence (SEV-SNP, or TDX with `attester=SimulatedTdx`) for the handshake with
    `nonce`, its report_data committing to the GPU digest `bound` (or, with None, to the handshake alone,
    as a server without GPUs reports)."""
    server_key = _raw(X25519PrivateKey.generate().public_key())
    session = report_data(nonce, server_key, FINGERPRINT, WEIGHTS, LAYERS, VERSION)
    cvm = attester(vendor)
    report, certs = cvm.report(session if bound is None else composite_report_data(session, bound))
    return Evidence(cvm.platform, report, certs, server_key, FINGERPRINT, WEIGHTS, LAYERS, VERSION)


def test_the_cvm_report_must_commit_to_exactly_the_gpu_evidence_presented(vendor: Path) -> None:
    gpus, nonce = hopper()
    policy = AttestationPolicy.load(vendor / "policy.json")
    client = ClientHandshake(policy, FINGERPRINT, LAYERS, VERSION, nonce=nonce)  # the nonce the genuine GPUs answered
    evidence = _server_evidence(vendor, nonce, gpu_evidence_digest(gpus))
    channel, cvm, verified = finish_with_gpus(client, evidence, gpus, now=WHEN)
    assert cvm.simulated and len(verified) == 8 and channel.seal(b"x") != b"x"
    # the same certificates, other bytes
    restyled = dataclasses.replace(gpus[0], certificates=gpus[0].certificates + b"\n")
    for presented in (gpus[:7], gpus[::-1], (restyled, *gpus[1:])):
        with pytest.raises(AttestationError, match=r"\(binding\)"):
            finish_with_gpus(client, evidence, presented, now=WHEN)
    unbound = _server_evidence(vendor, nonce, None)  # a CVM that vouches for no GPU evidence
    with pytest.raises(AttestationError, match=r"\(binding\)"):
        finish_with_gpus(client, unbound, gpus, now=WHEN)
    with pytest.raises(AttestationError, match=r"\(gpu-evidence\).*no GPU evidence"):
        finish_with_gpus(client, evidence, (), now=WHEN)
    fresh = ClientHandshake(policy, FINGERPRINT, LAYERS, VERSION)  # a new handshake, the old GPU reports
    with pytest.raises(AttestationError, match=r"\(gpu-nonce\)"):
        finish_with_gpus(fresh, _server_evidence(vendor, fresh.nonce, gpu_evidence_digest(gpus)), gpus, now=WHEN)


@pytest.fixture(scope="module")
def tdx_vendor(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tdx-vendor")
    tdx_sim_init(folder)
    return folder


def test_a_td_quote_must_commit_to_exactly_the_gpu_evidence_presented(tdx_vendor: Path) -> None:
    """The same binding on TDX: the quote's report_data is the composite, checked before the measurements."""
    gpus, nonce = hopper()
    client = ClientHandshake(AttestationPolicy.load(tdx_vendor / "policy.json"), FINGERPRINT, LAYERS, VERSION,
                             nonce=nonce)
    evidence = _server_evidence(tdx_vendor, nonce, gpu_evidence_digest(gpus), SimulatedTdx)
    channel, cvm, verified = finish_with_gpus(client, evidence, gpus, now=WHEN)
    assert isinstance(cvm, TdxVerified) and cvm.simulated and len(verified) == 8 and channel.seal(b"x") != b"x"
    for presented in (gpus[:7], gpus[::-1]):
        with pytest.raises(AttestationError, match=r"\(binding\)"):
            finish_with_gpus(client, evidence, presented, now=WHEN)
    with pytest.raises(AttestationError, match=r"\(binding\)"):  # a TD that vouches for no GPU evidence
        finish_with_gpus(client, _server_evidence(tdx_vendor, nonce, None, SimulatedTdx), gpus, now=WHEN)
    with pytest.raises(AttestationError, match=r"\(binding\)"):  # GPU-bound evidence to a client that expects none
        client.finish(evidence)
