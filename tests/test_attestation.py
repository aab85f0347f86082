"""Attestation without a network: genuine AMD evidence, the policy file, every check of the verifier,
and sealed frames. The same verifier checks simulated and genuine reports; only the anchors differ."""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
import struct
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.x509.oid import NameOID

from splitllm.attestation.evidence import AttestationUnavailable, load_attester
from splitllm.attestation.handshake import ClientHandshake, Evidence, _raw, answer, load_certificate
from splitllm.attestation.policy import TCB_FLOORS, Anchor, AttestationPolicy, PolicyError, pinned_anchor
from splitllm.attestation.sealing import SealedChannel, SealError
from splitllm.attestation.simulation import SimulatedSnp, _der_int, sim_init
from splitllm.attestation.snp import (
    HWID_OID, POLICY_DEBUG, POLICY_MIGRATE_MA, SIGNED_SIZE, SIGNING_KEY_VLEK, SPL_OIDS, TCB_FIELDS, SnpReport, Tcb,
    CERT_GUIDS, parse_cert_table,
)
from splitllm.attestation.verify import (
    AttestationError, verify_chain, verify_evidence, verify_report_signature, verify_vcek_binding,
)
from splitllm.options import option
from splitllm.protocol.messages import PROTOCOL_VERSION

DATA = Path(__file__).parent / "data" / "sev-snp"
DOCS = Path(__file__).resolve().parents[1] / "docs"
FINGERPRINT = "ab" * 32
WEIGHTS = "5e" * 32
LAYERS = (2, 28)
VERSION = 2
WHEN = datetime.datetime(2026, 12, 1, tzinfo=datetime.UTC)  # inside every genuine VCEK's validity
ALL_AMD = ["amd-milan", "amd-genoa", "amd-turin"]
# Where AMD's ABI puts the report fields the tampering tests rewrite: (offset, struct format).
_FIELDS = {"version": (0x00, "<I"), "policy": (0x08, "<Q"), "vmpl": (0x30, "<I"), "signer_info": (0x48, "<I")}


def _genuine(name: str) -> tuple[SnpReport, x509.Certificate]:
    """A report and the VCEK that signed it, as AMD's firmware and key service issued them (tests/data/sev-snp)."""
    report = SnpReport.parse(bytes.fromhex((DATA / f"report_{name}.hex").read_text().strip()))
    return report, load_certificate((DATA / f"vcek_{name}.der").read_bytes())


def _tampered(report: SnpReport, **fields: int) -> SnpReport:
    """A copy of a genuine report with fields rewritten in its bytes (so its signature no longer holds)."""
    raw = bytearray(report.raw)
    for name, value in fields.items():
        offset, fmt = _FIELDS[name]
        struct.pack_into(fmt, raw, offset, value)
    return SnpReport.parse(bytes(raw))


@pytest.fixture(scope="module")
def genuine() -> tuple[SnpReport, x509.Certificate]:
    """A Milan report from firmware older than this release's floor, and its VCEK."""
    return _genuine("milan")


@pytest.mark.parametrize("name, product", [("milan", "milan"), ("milan_v3", "milan"), ("genoa", "genoa")])
def test_genuine_evidence_verifies_against_amds_pinned_root(name: str, product: str) -> None:
    report, vcek = _genuine(name)
    anchor = verify_chain(vcek, tuple(pinned_anchor(p) for p in ("turin", "genoa", "milan")), WHEN)
    assert anchor.product == product and anchor.pinned
    verify_report_signature(report, vcek)
    verify_vcek_binding(report, vcek, product)
    assert not report.debug and report.vmpl == 0 and report.version in (2, 3)


def test_every_signed_byte_of_the_genuine_report_is_covered(genuine) -> None:  # type: ignore[no-untyped-def]
    report, vcek = genuine
    for i in range(SIGNED_SIZE):
        raw = bytearray(report.raw)
        raw[i] ^= 0x01
        with pytest.raises(AttestationError) as err:
            verify_report_signature(SnpReport.parse(bytes(raw)), vcek)
        assert err.value.check == "signature", i
    for offset in (0x2A0, 0x2A0 + 72):  # the signature's r and s themselves
        raw = bytearray(report.raw)
        raw[offset] ^= 0x01
        with pytest.raises(AttestationError, match=r"\(signature\)"):
            verify_report_signature(SnpReport.parse(bytes(raw)), vcek)


def test_a_tampered_vcek_or_another_products_root_breaks_the_chain(genuine) -> None:  # type: ignore[no-untyped-def]
    _, vcek = genuine
    der = bytearray((DATA / "vcek_milan.der").read_bytes())
    der[429] ^= 0x01  # inside the signed part (the TBS), in the subject public key
    with pytest.raises(AttestationError, match=r"\(chain\).*VCEK certificate's signature does not verify"):
        verify_chain(load_certificate(bytes(der)), (pinned_anchor("milan"),), WHEN)
    with pytest.raises(AttestationError, match=r"\(chain\).*amd-genoa, amd-turin"):
        verify_chain(vcek, (pinned_anchor("genoa"), pinned_anchor("turin")), WHEN)
    later = datetime.datetime(2031, 1, 1, tzinfo=datetime.UTC)
    with pytest.raises(AttestationError, match="VCEK certificate is not valid now"):
        verify_chain(vcek, (pinned_anchor("milan"),), later)


def test_the_genuine_vcek_belongs_to_its_chip_and_tcb(genuine) -> None:  # type: ignore[no-untyped-def]
    report, vcek = genuine
    other_chip = dataclasses.replace(report, chip_id=bytes(64))
    with pytest.raises(AttestationError, match=r"\(vcek\).*another chip"):
        verify_vcek_binding(other_chip, vcek, "milan")
    other_tcb = dataclasses.replace(report, reported_tcb=Tcb(3, 0, 9, 115).pack("milan"))
    with pytest.raises(AttestationError, match=r"\(vcek\).*snp level 8"):
        verify_vcek_binding(other_tcb, vcek, "milan")


def _policy(folder: Path, fields: dict) -> AttestationPolicy:
    path = folder / "policy.json"
    path.write_text(json.dumps({"platform": "sev-snp", **fields}))
    return AttestationPolicy.load(path)


def _amd_policy(folder: Path, report: SnpReport, **fields: object) -> AttestationPolicy:
    """A policy trusting AMD's roots and the genuine report's measurement."""
    return _policy(folder, {"trust_anchors": ALL_AMD, "measurements": [report.measurement.hex()], **fields})


@pytest.mark.parametrize("name", ["milan_v3", "genoa"])
def test_genuine_evidence_meets_the_default_policy_only_for_its_own_handshake(name: str, tmp_path: Path) -> None:
    report, vcek = _genuine(name)
    policy = _amd_policy(tmp_path, report)
    verified = verify_evidence(report, vcek, policy, report.report_data, WHEN)
    assert verified.product == name.removesuffix("_v3") and not verified.simulated
    assert Tcb.parse(report.reported_tcb, verified.product) == TCB_FLOORS[verified.product]
    with pytest.raises(AttestationError, match=r"\(binding\)"):
        verify_evidence(report, vcek, policy, b"\x01" * 64, WHEN)
    strict = _amd_policy(tmp_path, report, min_tcb={verified.product: {"snp": 25}})
    with pytest.raises(AttestationError, match=r"\(tcb\).*minimum in snp"):
        verify_evidence(report, vcek, strict, report.report_data, WHEN)


def test_firmware_below_the_shipped_floor_is_refused_without_any_min_tcb(genuine,  # type: ignore[no-untyped-def]
                                                                         tmp_path: Path) -> None:
    """The older genuine Milan report passes every other check; a policy naming no minimum still refuses its TCB."""
    report, vcek = genuine
    policy = _amd_policy(tmp_path, report)
    assert policy.min_tcb == TCB_FLOORS
    with pytest.raises(AttestationError) as err:
        verify_evidence(report, vcek, policy, report.report_data, WHEN)
    assert err.value.check == "tcb" and "milan minimum in bootloader, snp, microcode" in str(err.value)


def test_a_policy_may_raise_the_floor_never_lower_it(tmp_path: Path) -> None:
    report, _ = _genuine("genoa")
    with pytest.raises(PolicyError, match=r"'min_tcb' milan: snp, microcode below this release's floor"):
        _amd_policy(tmp_path, report, min_tcb={"milan": {"snp": 8, "microcode": 115}})
    raised = _amd_policy(tmp_path, report, min_tcb={"turin": {"fmc": 2}, "genoa": {"snp": 27}})
    assert raised.min_tcb["turin"] == dataclasses.replace(TCB_FLOORS["turin"], fmc=2)
    assert raised.min_tcb["genoa"].snp == 27 and raised.min_tcb["milan"] == TCB_FLOORS["milan"]
    with pytest.raises(PolicyError, match="below this release's floor"):  # in code too, not only in files
        dataclasses.replace(raised,
                            min_tcb={**raised.min_tcb, "genoa": Tcb(bootloader=10, tee=0, snp=22, microcode=84)})


@pytest.mark.parametrize(
    "fields, check",
    [
        ({"vmpl": 1}, "vmpl"),
        ({"vmpl": 3}, "vmpl"),
        ({"version": 1}, "report"),
        ({"version": 6}, "report"),
        ({"signer_info": SIGNING_KEY_VLEK << 2}, "report"),  # signed by a VLEK
        ({"signer_info": 7 << 2}, "report"),  # signed by no key
        ({"signer_info": 1 << 5}, "report"),  # a reserved bit
        ({"policy": 0x1001F}, "report"),  # the must-be-one bit clear
        ({"policy": 0x3001F | 1 << 40}, "report"),  # a reserved bit
        ({"policy": 0x3001F | POLICY_MIGRATE_MA}, "migration"),
        ({"policy": 0x3001F | POLICY_DEBUG}, "debug"),
    ],
)
def test_a_report_of_unknown_form_or_from_a_guest_below_vmpl_0_is_refused(fields: dict, check: str,
                                                                          tmp_path: Path) -> None:
    report, vcek = _genuine("milan_v3")
    policy = _amd_policy(tmp_path, report)
    with pytest.raises(AttestationError) as err:
        verify_evidence(_tampered(report, **fields), vcek, policy, report.report_data, WHEN)
    assert err.value.check == check, err.value


def test_allowed_guest_settings_and_every_defined_version_go_on_to_the_signature(tmp_path: Path) -> None:
    """Past these checks, the tampered bytes fail the signature: nothing else refused them."""
    report, vcek = _genuine("milan_v3")
    allowing = _amd_policy(tmp_path, report, allow_migration_agent=True, allow_debug=True)
    tampered = [_tampered(report, policy=0x3001F | bit) for bit in (POLICY_MIGRATE_MA, POLICY_DEBUG)]
    tampered += [_tampered(report, version=version) for version in (2, 4, 5)]
    for changed in tampered:
        with pytest.raises(AttestationError, match=r"\(signature\)"):
            verify_evidence(changed, vcek, allowing, report.report_data, WHEN)


_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA384()), salt_length=48)


def _issue(
    subject: str, issuer: str, signer: rsa.RSAPrivateKey, key: object, *, ca: bool | None = None,
    sign_certs: bool = True,
    rsa_padding: padding.AsymmetricPadding = _PSS, extensions: dict[str, bytes] | None = None,
) -> x509.Certificate:
    """A certificate from a vendor made here, to issue what AMD never would; the verifier reads it as it reads AMD's."""
    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    builder = (
        x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer))
        .public_key(key.public_key())  # type: ignore[attr-defined]
        .serial_number(1).not_valid_before(WHEN - datetime.timedelta(days=1))
        .not_valid_after(WHEN + datetime.timedelta(days=1))
    )
    if ca is not None:
        builder = builder.add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    if ca and sign_certs:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=False, content_commitment=False, key_encipherment=False, data_encipherment=False,
            key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
        ), critical=True)
    for oid, value in (extensions or {}).items():
        builder = builder.add_extension(x509.UnrecognizedExtension(x509.ObjectIdentifier(oid), value), critical=False)
    return builder.sign(signer, hashes.SHA384(), rsa_padding=rsa_padding)


@dataclasses.dataclass(frozen=True)
class _Vendor:
    ark_key: rsa.RSAPrivateKey
    ask_key: rsa.RSAPrivateKey
    ark: x509.Certificate
    ask: x509.Certificate

    def anchor(self, ask: x509.Certificate | None = None) -> Anchor:
        return Anchor("milan", self.ark, ask or self.ask, pinned=False)

    def vcek(self, **options: object) -> x509.Certificate:
        return _issue("VCEK", "ASK", self.ask_key, ec.generate_private_key(ec.SECP384R1()), **options)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def vendor_here() -> _Vendor:
    ark_key, ask_key = rsa.generate_private_key(65537, 4096), rsa.generate_private_key(65537, 4096)
    return _Vendor(ark_key, ask_key, _issue("ARK", "ARK", ark_key, ark_key, ca=True),
                   _issue("ASK", "ARK", ark_key, ask_key, ca=True))


def test_certificates_are_held_to_amds_algorithms_and_roles(vendor_here: _Vendor) -> None:
    v = vendor_here
    assert verify_chain(v.vcek(), (v.anchor(),), WHEN) == v.anchor()
    refused = [
        ((v.vcek(rsa_padding=padding.PKCS1v15()), v.anchor()), "signed with 1.2.840.113549.1.1.12, not AMD's RSA-PSS"),
        ((v.vcek(ca=True), v.anchor()), "VCEK certificate is a CA"),
        ((_issue("VCEK", "ASK", v.ask_key, ec.generate_private_key(ec.SECP256R1())), v.anchor()), "not an ECDSA P-384"),
        ((v.vcek(), v.anchor(_issue("ASK", "ARK", v.ark_key, v.ask_key))), "ASK certificate is not a CA"),
        ((v.vcek(), v.anchor(_issue("ASK", "ARK", v.ark_key, v.ask_key, ca=True, sign_certs=False))), "keyCertSign"),
    ]
    for (vcek, anchor), reason in refused:
        with pytest.raises(AttestationError, match=r"\(chain\).*" + re.escape(reason)):
            verify_chain(vcek, (anchor,), WHEN)


def test_a_certificate_of_an_unsupported_or_weaker_algorithm_is_a_named_refusal() -> None:
    der = (DATA / "vcek_milan.der").read_bytes()
    pss, sha384 = bytes.fromhex("06092a864886f70d01010a"), bytes.fromhex("0609608648016503040202")  # their OIDs
    cases = [
        (der.replace(pss, bytes.fromhex("06092a864886f70d010163")), r"signed with 1\.2\.840\.113549\.1\.1\.99"),
        (der.replace(sha384, bytes.fromhex("0609608648016503040201")), "not AMD's RSA-PSS with SHA-384"),  # SHA-256
        (der.replace(sha384, bytes.fromhex("0609608648016503040263")), r"cannot be checked \(UnsupportedAlgorithm"),
    ]
    for tampered, reason in cases:
        with pytest.raises(AttestationError, match=r"\(chain\).*" + reason):
            verify_chain(load_certificate(tampered), (pinned_anchor("milan"),), WHEN)


def _spl(tcb: Tcb, product: str, skip: str = "") -> dict[str, bytes]:
    return {SPL_OIDS[n]: _der_int(getattr(tcb, n)) for n in TCB_FIELDS[product] if n != skip}


def test_a_vcek_names_its_chip_and_tcb_as_amd_lays_them_out_for_its_product(vendor_here: _Vendor) -> None:
    genoa, _ = _genuine("genoa")
    tcb = Tcb.parse(genoa.reported_tcb, "genoa")
    refused = [
        (genoa, "genoa", _spl(tcb, "genoa"), "names no chip"),
        (genoa, "genoa", {**_spl(tcb, "genoa", skip="snp"), HWID_OID: genoa.chip_id}, "names no snp level"),
        (genoa, "genoa", {**_spl(tcb, "genoa"), HWID_OID: genoa.chip_id[:8]}, "hwID is 8 bytes; a genoa VCEK's is 64"),
    ]
    turin_tcb = TCB_FLOORS["turin"]
    turin = dataclasses.replace(genoa, chip_id=genoa.chip_id[:8] + bytes(56), reported_tcb=turin_tcb.pack("turin"))
    verify_vcek_binding(turin, vendor_here.vcek(extensions={**_spl(turin_tcb, "turin"), HWID_OID: turin.chip_id[:8]}),
                        "turin")
    refused += [
        (turin, "turin", {**_spl(turin_tcb, "turin"), HWID_OID: turin.chip_id},
         "hwID is 64 bytes; a turin VCEK's is 8"),
        (turin, "turin", {**_spl(turin_tcb, "turin", skip="fmc"), HWID_OID: turin.chip_id[:8]}, "names no fmc level"),
        (dataclasses.replace(turin, reported_tcb=turin_tcb.pack("milan")), "turin",
         {**_spl(turin_tcb, "turin"), HWID_OID: turin.chip_id[:8]}, "issued for tee level 1, the report's is 0"),
    ]
    for report, product, extensions, reason in refused:
        with pytest.raises(AttestationError, match=r"\(vcek\).*" + re.escape(reason)):
            verify_vcek_binding(report, vendor_here.vcek(extensions=extensions), product)


def test_a_vlek_under_amds_asvk_cannot_stand_in_for_a_vcek(vendor_here: _Vendor) -> None:
    v = vendor_here
    asvk = _issue("SEV-VLEK-Milan", "ARK", v.ark_key, v.ask_key, ca=True)  # another CA under the same root
    vlek = _issue("SEV-VLEK", "SEV-VLEK-Milan", v.ask_key, ec.generate_private_key(ec.SECP384R1()),
                  extensions=_spl(TCB_FLOORS["milan"], "milan"))
    assert asvk.issuer == v.ark.subject
    with pytest.raises(AttestationError, match=r"\(chain\).*VLEKs, issued by AMD's ASVK, are not accepted"):
        verify_chain(vlek, (v.anchor(),), WHEN)


def test_simulated_turin_evidence_verifies_with_its_short_hwid_and_own_tcb_layout(tmp_path: Path) -> None:
    policy_path = sim_init(tmp_path, product="turin")
    client, evidence, _ = _handshake(tmp_path, AttestationPolicy.load(policy_path))
    _, verified = client.finish(evidence)
    assert verified.product == "turin" and verified.report.chip_id[8:] == bytes(56)
    assert Tcb.parse(verified.report.reported_tcb, "turin") == TCB_FLOORS["turin"]


@pytest.mark.parametrize(
    "change",
    [{"key": 32}, {"layers": "12"}, {"layers": [2, True]}, {"version": 4.9}, {"version": "4"}, {"report": 2**45},
     {"certs": {"vcek": "pem"}}, {"certs": [("vcek", b"")]}, {"fingerprint": "zz" * 32}, {"platform": None},
     {"weights": b"\x5e" * 32}, {"weights": "5E" * 32}, {"weights": "5e" * 31}, {"weights": None}],
)
def test_evidence_fields_must_have_their_exact_types(vendor: Path, change: dict) -> None:
    _, evidence, _ = _handshake(vendor)
    with pytest.raises(AttestationError) as err:
        Evidence.from_header({**evidence.header(1), **change})
    assert err.value.check == "evidence" and next(iter(change)) in str(err.value)


def test_policy_files_are_refused_with_the_reason(tmp_path: Path) -> None:
    measurement = "00" * 48
    amd = {"trust_anchors": ["amd-milan"], "measurements": [measurement]}
    cases = [
        ({"trust_anchors": ["amd-milan"]}, "'measurements' must list"),
        ({"trust_anchors": ["amd-milan"], "measurements": []}, "is empty"),
        ({"trust_anchors": ["amd-milan"], "measurements": ["abcd"]}, "2 bytes, expected 48"),
        ({"trust_anchors": ["amd-rome"], "measurements": [measurement]}, "unknown trust anchor 'amd-rome'"),
        ({**amd, "allow_debug": "no"}, "'allow_debug' must be"),
        ({**amd, "allow_migration_agent": 1}, "'allow_migration_agent' must be"),
        ({**amd, "min_tcbs": {}}, "unknown keys min_tcbs"),
        ({**amd, "min_tcb": {"milan": {"snp": 300}}}, "levels 0-255"),
        ({**amd, "min_tcb": {"snp": 30}}, "'min_tcb' maps products"),
        ({**amd, "min_tcb": {"milan": {"fmc": 1}}}, "milan: maps some of bootloader, tee, snp, microcode"),
        ({**amd, "min_tcb": {"genoa": {"snp": True}}}, "levels 0-255"),
        ({"platform": "tdx", "trust_anchors": ["amd-milan"], "measurements": [measurement]},
         "requirements in a .tdx. section"),
        ({"measurements": [measurement]}, "at least one root"),
        ({**amd, "trust_anchors": "amd-milan"}, "'trust_anchors' must list"),
        ({**amd, "trust_anchors": {"amd-milan": True}}, "'trust_anchors' must list"),
        ({**amd, "weights": ["ab"]}, "1 bytes, expected 32"),
        ({**amd, "weights": "5e" * 32}, "'weights' must be a list of hex strings"),
        ({**amd, "weights": [0x5E]}, "'weights' must be a list of hex strings"),
        ({**amd, "weights": ["zz" * 32]}, "'weights': 'zz.*' is not hex"),
    ]
    for fields, reason in cases:
        with pytest.raises(PolicyError, match=reason):
            _policy(tmp_path, fields)
    with pytest.raises(PolicyError, match="bad.json: Expecting"):
        (tmp_path / "bad.json").write_text("{")
        AttestationPolicy.load(tmp_path / "bad.json")


def test_policy_files_are_parsed_strictly(tmp_path: Path) -> None:
    measurement = "00" * 48
    doubled = tmp_path / "doubled.json"
    doubled.write_text(f'{{"trust_anchors": ["amd-milan"], "measurements": ["{measurement}"], '
                       f'"allow_debug": false, "allow_debug": true}}')
    with pytest.raises(PolicyError, match="doubled.json: key 'allow_debug' is given twice"):
        AttestationPolicy.load(doubled)
    for product in ("milan", "genoa"):
        for role in ("ark", "ask"):
            (tmp_path / f"{product}-{role}.pem").write_bytes(
                getattr(pinned_anchor(product), role).public_bytes(serialization.Encoding.PEM))

    def file_anchor(product: str, ark: str, ask: str, **more: object) -> dict:
        return {"trust_anchors": [{"product": product, "ark": f"{ark}.pem", "ask": f"{ask}.pem", **more}],
                "measurements": [measurement]}

    assert _policy(tmp_path, file_anchor("milan", "milan-ark", "milan-ask")).anchors == (pinned_anchor("milan"),)
    cases = [
        (file_anchor("turin", "milan-ark", "milan-ask"), "it is AMD's milan root, labelled turin"),
        (file_anchor("milan", "milan-ark", "genoa-ask"), "AMD's milan root with an ASK that is not AMD's milan ASK"),
        (file_anchor("milan", "milan-ark", "milan-ask", pinned=True), "a file trust anchor is exactly"),
        ({**file_anchor("milan", "milan-ark", "milan-ask"), "simulated": True}, "beside AMD's roots"),
        ({"trust_anchors": ["amd-genoa"], "measurements": [measurement], "simulated": True}, "beside AMD's roots"),
    ]
    for fields, reason in cases:
        with pytest.raises(PolicyError, match=re.escape(reason)):
            _policy(tmp_path, fields)


def test_a_root_named_like_amds_but_not_amds_is_refused(vendor: Path, tmp_path: Path) -> None:
    key = rsa.generate_private_key(65537, 2048)
    impostor = (x509.CertificateBuilder().subject_name(pinned_anchor("genoa").ark.subject)
                .issuer_name(pinned_anchor("genoa").ark.subject).public_key(key.public_key()).serial_number(1)
                .not_valid_before(WHEN).not_valid_after(WHEN + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    (tmp_path / "ark.pem").write_bytes(impostor.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "ask.pem").write_bytes((vendor / "ask.pem").read_bytes())
    with pytest.raises(PolicyError, match="bears the name of AMD's genoa root but is not that root"):
        _policy(tmp_path, {"simulated": True, "measurements": ["00" * 48],
                           "trust_anchors": [{"product": "genoa", "ark": "ark.pem", "ask": "ask.pem"}]})


def test_the_docs_name_the_protocol_version_and_what_each_attestation_protects() -> None:
    assert set(re.findall(r"protocol version \((\d+)\)", (DOCS / "protocol.md").read_text())) == {str(PROTOCOL_VERSION)}
    said = option("serve", "attestation").help
    assert (
        "simulated" in said
        and "protects nothing" in said
        and "tdx (this TD's quote with its collateral, which clients verify)" in said
    )


def test_a_simulated_root_is_refused_unless_the_policy_says_so(vendor: Path) -> None:
    data = json.loads((vendor / "policy.json").read_text())
    assert data["simulated"] is True
    del data["simulated"]
    with pytest.raises(PolicyError, match="not AMD's"):
        AttestationPolicy.from_dict(data, vendor)
    assert AttestationPolicy.load(vendor / "policy.json").simulated


def _handshake(vendor: Path, policy: AttestationPolicy | None = None, attester: object = None,
               **claims: object) -> tuple:
    """One attest round trip between a client handshake and `answer` (claims override the server's)."""
    policy = policy or AttestationPolicy.load(vendor / "policy.json")
    client = ClientHandshake(policy, FINGERPRINT, LAYERS, VERSION)
    server = dict(fingerprint=FINGERPRINT, weights=WEIGHTS, layers=LAYERS, version=VERSION) | claims
    evidence, server_channel = answer(client.request(1), attester or SimulatedSnp(vendor), **server)  # type: ignore[arg-type]
    return client, Evidence.from_header(evidence.header(1)), server_channel


def test_simulated_evidence_passes_the_same_verifier_and_opens_a_sealed_channel(vendor: Path) -> None:
    client, evidence, server_channel = _handshake(vendor)
    channel, verified = client.finish(evidence)
    assert verified.simulated and verified.product == "milan"
    assert server_channel.open(channel.seal(b"open")) == b"open"
    assert channel.open(server_channel.seal(b"opened")) == b"opened"


@pytest.mark.parametrize(
    "claims, check",
    [({"fingerprint": "cd" * 32}, "model"), ({"layers": (3, 28)}, "split"), ({"version": 1}, "version")],
)
def test_an_attested_server_running_something_else_is_refused(vendor: Path, claims: dict, check: str) -> None:
    client, evidence, _ = _handshake(vendor, **claims)
    with pytest.raises(AttestationError) as err:
        client.finish(evidence)
    assert err.value.check == check and "no hidden state was sent" in str(err.value)


def test_replayed_and_relayed_evidence_fail_the_binding(vendor: Path) -> None:
    client, evidence, _ = _handshake(vendor)
    replay = ClientHandshake(client.policy, FINGERPRINT, LAYERS, VERSION)  # a new handshake, an old report
    with pytest.raises(AttestationError, match=r"\(binding\)"):
        replay.finish(evidence)
    intruder = _raw(X25519PrivateKey.generate().public_key())  # an honest report under a man in the middle's key
    with pytest.raises(AttestationError, match=r"\(binding\)"):
        client.finish(dataclasses.replace(evidence, server_key=intruder))
    with pytest.raises(AttestationError, match=r"\(binding\)"):  # an honest report, other weights claimed
        client.finish(dataclasses.replace(evidence, weights="cd" * 32))


def test_each_policy_field_is_checked(vendor: Path, tmp_path: Path) -> None:
    policy = AttestationPolicy.load(vendor / "policy.json")
    cases = [
        (dataclasses.replace(policy, measurements=frozenset({bytes(48)})), "measurement"),
        (dataclasses.replace(policy,
                             min_tcb={**policy.min_tcb, "milan": Tcb(bootloader=4, tee=0, snp=24, microcode=220)}),
         "tcb"),
        (dataclasses.replace(policy, host_data=frozenset({b"\x01" * 32})), "host_data"),
        (dataclasses.replace(policy, image_ids=frozenset({b"\x01" * 16})), "image_id"),
        (dataclasses.replace(policy, weights=frozenset({b"\x01" * 32})), "weights"),
        (dataclasses.replace(policy, anchors=(pinned_anchor("milan"),)), "chain"),
    ]
    for changed, check in cases:
        client, evidence, _ = _handshake(vendor, changed)
        with pytest.raises(AttestationError) as err:
            client.finish(evidence)
        assert err.value.check == check
    client, evidence, _ = _handshake(vendor, dataclasses.replace(policy, weights=frozenset({bytes.fromhex(WEIGHTS)})))
    client.finish(evidence)  # the weights the policy names
    debug = tmp_path / "debug"
    sim_init(debug, debug=True)
    client, evidence, _ = _handshake(debug)
    with pytest.raises(AttestationError, match=r"\(debug\)"):
        client.finish(evidence)
    allowed = dataclasses.replace(AttestationPolicy.load(debug / "policy.json"), allow_debug=True)
    client, evidence, _ = _handshake(debug, allowed)
    client.finish(evidence)


def test_malformed_evidence_is_a_named_failure(vendor: Path) -> None:
    client, evidence, _ = _handshake(vendor)
    header = evidence.header(1)
    for broken in ({**header, "key": b"short"}, {**header, "layers": "x"},
                   {k: v for k, v in header.items() if k != "report"}):
        with pytest.raises(AttestationError, match=r"\(evidence\)"):
            Evidence.from_header(broken)
    with pytest.raises(AttestationError, match=r"\(evidence\).*1184 bytes"):
        client.finish(dataclasses.replace(evidence, report=evidence.report[:-1]))
    with pytest.raises(AttestationError, match=r"\(evidence\).*no VCEK"):
        client.finish(dataclasses.replace(evidence, certs={}))
    with pytest.raises(AttestationError, match=r"\(platform\)"):
        client.finish(dataclasses.replace(evidence, platform="tdx"))


def test_sealed_frames_refuse_replay_reordering_and_tampering() -> None:
    a, b = SealedChannel(b"k" * 32, b"q" * 32), SealedChannel(b"q" * 32, b"k" * 32)
    first, second, third = a.seal(b"one"), a.seal(b"two"), a.seal(b"three")
    assert b.open(first) == b"one"
    for message, check in ((first, "replayed"), (third, "reordered")):
        fresh = SealedChannel(b"q" * 32, b"k" * 32)
        fresh.open(first)
        with pytest.raises(SealError) as err:
            fresh.open(message)
        assert err.value.check == check
    flipped = bytearray(second)
    flipped[-1] ^= 0x01
    with pytest.raises(SealError, match="tampered"):
        b.open(bytes(flipped))
    with pytest.raises(SealError, match="closed"):  # after one refusal the channel takes nothing more
        b.open(second)
    assert b"two" not in second and len(second) == len(b"two") + 24


def _pack_cert_table(certs: dict[str, bytes]) -> bytes:
    """A certificate table as the firmware lays it out (GUID, offset, length; an all-zero entry ends it)."""
    by_role = {role: guid for guid, role in CERT_GUIDS.items()}
    offset, entries, blobs = 24 * (len(certs) + 1), b"", b""
    for role, der in certs.items():
        entries += struct.pack("<16sII", by_role[role].bytes_le, offset, len(der))
        blobs, offset = blobs + der, offset + len(der)
    return entries + bytes(24) + blobs


def test_the_certificate_table_round_trips() -> None:
    certs = {"vcek": b"v" * 10, "ask": b"a" * 3, "ark": b"r" * 5}
    assert parse_cert_table(_pack_cert_table(certs)) == certs
    with pytest.raises(ValueError, match="points past its end"):
        parse_cert_table(_pack_cert_table(certs)[:-1])
    with pytest.raises(ValueError, match="no terminating entry"):
        parse_cert_table(b"\x01" * 16 + bytes(8))  # one entry, of nothing, and no zero entry after it


def test_a_server_without_the_device_refuses_to_attest(vendor: Path) -> None:
    for kind in ("sev-snp", "tdx"):
        with pytest.raises(AttestationUnavailable, match="not"):
            load_attester(kind)
    with pytest.raises(ValueError, match="needs --attestation-sim"):
        load_attester("simulated")
    with pytest.raises(ValueError, match="not a folder from"):
        load_attester("simulated", str(vendor / "missing"))
    assert load_attester("none") is None and load_attester("simulated", str(vendor)).platform == "sev-snp"
