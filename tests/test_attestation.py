"""Attestation without a network: genuine AMD evidence, the policy file, every check of the verifier,
and sealed frames. The same verifier checks simulated and genuine reports; only the anchors differ."""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from splitllm.attestation.evidence import AttestationUnavailable, load_attester
from splitllm.attestation.handshake import ClientHandshake, Evidence, _raw, answer, load_certificate
from splitllm.attestation.policy import AttestationPolicy, PolicyError, pinned_anchor
from splitllm.attestation.sealing import SealedChannel, SealError
from splitllm.attestation.simulation import SimulatedSnp, sim_init
from splitllm.attestation.snp import SIGNED_SIZE, SnpReport, Tcb, pack_cert_table, parse_cert_table
from splitllm.attestation.verify import (
    AttestationError, verify_chain, verify_evidence, verify_report_signature, verify_vcek_binding,
)

DATA = Path(__file__).parent / "data" / "sev-snp"
FINGERPRINT = "ab" * 32
WEIGHTS = "5e" * 32
LAYERS = (2, 28)
VERSION = 2
WHEN = datetime.datetime(2026, 12, 1, tzinfo=datetime.timezone.utc)  # inside the genuine VCEK's validity (to 2030-04)


@pytest.fixture(scope="module")
def genuine() -> tuple[SnpReport, object]:
    """A Milan report and the VCEK that signed it, as AMD's firmware and key service issued them."""
    report = SnpReport.parse(bytes.fromhex((DATA / "report_milan.hex").read_text().strip()))
    return report, load_certificate((DATA / "vcek_milan.der").read_bytes())


def test_genuine_milan_evidence_verifies_against_amds_pinned_root(genuine) -> None:  # type: ignore[no-untyped-def]
    report, vcek = genuine
    anchor = verify_chain(vcek, None, tuple(pinned_anchor(p) for p in ("genoa", "turin", "milan")), WHEN)
    assert anchor.product == "milan" and anchor.pinned
    verify_report_signature(report, vcek)
    verify_vcek_binding(report, vcek, "milan")
    assert Tcb.parse(report.reported_tcb, "milan") == Tcb(bootloader=3, tee=0, snp=8, microcode=115)
    assert not report.debug and report.version == 2


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
    der[200] ^= 0x01  # inside the signed part (the TBS), in the subject public key
    with pytest.raises(AttestationError, match=r"\(chain\)"):
        verify_chain(load_certificate(bytes(der)), None, (pinned_anchor("milan"),), WHEN)
    with pytest.raises(AttestationError, match=r"\(chain\).*amd-genoa, amd-turin"):
        verify_chain(vcek, None, (pinned_anchor("genoa"), pinned_anchor("turin")), WHEN)
    later = datetime.datetime(2031, 1, 1, tzinfo=datetime.timezone.utc)
    with pytest.raises(AttestationError, match="VCEK certificate is not valid now"):
        verify_chain(vcek, None, (pinned_anchor("milan"),), later)


def test_the_genuine_vcek_belongs_to_its_chip_and_tcb(genuine) -> None:  # type: ignore[no-untyped-def]
    report, vcek = genuine
    other_chip = dataclasses.replace(report, chip_id=bytes(64))
    with pytest.raises(AttestationError, match=r"\(vcek\).*another chip"):
        verify_vcek_binding(other_chip, vcek, "milan")
    other_tcb = dataclasses.replace(report, reported_tcb=Tcb(3, 0, 9, 115).pack("milan"))
    with pytest.raises(AttestationError, match=r"\(vcek\).*snp level 8"):
        verify_vcek_binding(other_tcb, vcek, "milan")


def test_the_genuine_report_meets_a_policy_only_for_its_own_handshake(genuine, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    report, vcek = genuine
    policy = _policy(tmp_path, {"trust_anchors": ["amd-milan"], "measurements": [report.measurement.hex()],
                                "min_tcb": {"bootloader": 3, "snp": 8, "microcode": 115}})
    verified = verify_evidence(report, vcek, None, policy, report.report_data, WHEN)
    assert verified.product == "milan" and not verified.simulated
    with pytest.raises(AttestationError, match=r"\(binding\)"):
        verify_evidence(report, vcek, None, policy, bytes(64), WHEN)
    strict = dataclasses.replace(policy, min_tcb=Tcb(bootloader=3, tee=0, snp=9, microcode=115))
    with pytest.raises(AttestationError, match=r"\(tcb\).*snp"):
        verify_evidence(report, vcek, None, strict, report.report_data, WHEN)


def _policy(folder: Path, fields: dict) -> AttestationPolicy:
    path = folder / "policy.json"
    path.write_text(json.dumps({"platform": "sev-snp", **fields}))
    return AttestationPolicy.load(path)


def test_policy_files_are_refused_with_the_reason(tmp_path: Path) -> None:
    measurement = "00" * 48
    cases = [
        ({"trust_anchors": ["amd-milan"]}, "'measurements' must list"),
        ({"trust_anchors": ["amd-milan"], "measurements": []}, "is empty"),
        ({"trust_anchors": ["amd-milan"], "measurements": ["abcd"]}, "2 bytes, expected 48"),
        ({"trust_anchors": ["amd-rome"], "measurements": [measurement]}, "unknown trust anchor 'amd-rome'"),
        ({"trust_anchors": ["amd-milan"], "measurements": [measurement], "allow_debug": "no"}, "'allow_debug' must be"),
        ({"trust_anchors": ["amd-milan"], "measurements": [measurement], "min_tcbs": {}}, "unknown keys min_tcbs"),
        ({"trust_anchors": ["amd-milan"], "measurements": [measurement], "min_tcb": {"snp": 300}}, "levels 0-255"),
        ({"platform": "tdx", "trust_anchors": ["amd-milan"], "measurements": [measurement]}, "SEV-SNP evidence only"),
        ({"measurements": [measurement]}, "at least one root"),
        ({"trust_anchors": ["amd-milan"], "measurements": [measurement], "weights": ["ab"]}, "1 bytes, expected 32"),
    ]
    for fields, reason in cases:
        with pytest.raises(PolicyError, match=reason):
            _policy(tmp_path, fields)
    with pytest.raises(PolicyError, match="bad.json: Expecting"):
        (tmp_path / "bad.json").write_text("{")
        AttestationPolicy.load(tmp_path / "bad.json")


def test_a_simulated_root_is_refused_unless_the_policy_says_so(vendor: Path) -> None:
    data = json.loads((vendor / "policy.json").read_text())
    assert data["simulated"] is True
    del data["simulated"]
    with pytest.raises(PolicyError, match="not AMD's"):
        AttestationPolicy.from_dict(data, vendor)
    assert AttestationPolicy.load(vendor / "policy.json").simulated


def _handshake(vendor: Path, policy: AttestationPolicy | None = None, attester: object = None, **claims: object) -> tuple:
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


def test_each_policy_field_is_checked(vendor: Path, tmp_path: Path) -> None:
    policy = AttestationPolicy.load(vendor / "policy.json")
    cases = [
        (dataclasses.replace(policy, measurements=frozenset({bytes(48)})), "measurement"),
        (dataclasses.replace(policy, min_tcb=Tcb(bootloader=3, tee=0, snp=8, microcode=116)), "tcb"),
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
    for broken in ({**header, "key": b"short"}, {**header, "layers": "x"}, {k: v for k, v in header.items() if k != "report"}):
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


def test_the_certificate_table_round_trips() -> None:
    certs = {"vcek": b"v" * 10, "ask": b"a" * 3, "ark": b"r" * 5}
    assert parse_cert_table(pack_cert_table(certs)) == certs
    with pytest.raises(ValueError, match="points past its end"):
        parse_cert_table(pack_cert_table(certs)[:-1])
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
