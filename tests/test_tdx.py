"""TDX attestation without a network: a genuine TDX quote and the collateral Intel's PCS issued for its
platform, verified at a fixed time against Intel's pinned root; every tampered part refused by the
check it belongs to; the TD's measurements and report_data against the policy and the handshake; the
policy's `tdx` section; the server's collateral fetch from a PCCS on loopback; then the handshake with
a simulated vendor (labelled as such), through the same verifier, in process and over loopback."""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from splitllm.attestation.evidence import load_attester
from splitllm.attestation.handshake import ClientHandshake, Evidence, _raw, answer, report_data
from splitllm.attestation.policy import AttestationPolicy, PolicyError
from splitllm.attestation.tdx import (
    COLLATERAL, TdImage, TdxAttester, TdxPolicy, TdxVerified, intel_root, parse_quote, verify_quote, verify_tdx,
)
from splitllm.attestation.simulation import SimulatedSnp
from splitllm.attestation.tdx_simulation import SimulatedTdx, tdx_sim_init
from splitllm.attestation.verify import AttestationError

DATA = Path(__file__).parent / "data" / "tdx"
QUOTE = (DATA / "quote.bin").read_bytes()
COLLATERAL_JSON = (DATA / "collateral.json").read_text()
WHEN = datetime.datetime(2025, 6, 20, tzinfo=datetime.UTC)  # inside the collateral's validity
# Where the parts of a quote (version 4, certification data type 6) lie, in bytes.
HEADER, BODY = 0, 48  # the 48-byte header, then the 584-byte TD report
MRTD, RTMR1, REPORT_DATA = BODY + 136, BODY + 376, BODY + 520
SIGNATURE = 48 + 584 + 4  # the ECDSA signature by the attestation key (64), then that key (64)
ATTESTATION_KEY = SIGNATURE + 64
QE_REPORT = ATTESTATION_KEY + 64 + 6  # the QE's SGX report (384), its signature by the PCK (64), auth data
QE_SIGNATURE = QE_REPORT + 384
QE_AUTH_DATA = QE_SIGNATURE + 64 + 2
PCK_CHAIN = QE_AUTH_DATA + 32 + 6  # PEM: the PCK certificate, the PCK Platform CA, the root


def _flip(data: bytes, offset: int) -> bytes:
    out = bytearray(data)
    out[offset] ^= 0x01
    return bytes(out)


def _policy(**tdx: object) -> AttestationPolicy:
    report, _ = parse_quote(QUOTE)
    own = {"mrtd": report.mr_td.hex(), "rtmr0": report.rt_mr0.hex(), "rtmr1": report.rt_mr1.hex(),
           "rtmr2": report.rt_mr2.hex()}
    return AttestationPolicy.from_dict({"platform": "tdx", "tdx": {"measurements": [own], **tdx}}, DATA)


def test_the_genuine_quote_verifies_against_intels_pinned_root() -> None:
    report, fmspc = parse_quote(QUOTE)
    verified = verify_tdx(QUOTE, COLLATERAL_JSON.encode(), _policy().tdx, report.report_data, WHEN)  # type: ignore[arg-type]
    assert (verified.status, verified.product, verified.simulated) == ("UpToDate", "B0C06F000000", False)
    assert verified.report == report and report.measurement == report.mr_td and report.rt_mr3 == bytes(48)
    # Every chain in the evidence ends at the root pinned in the package, and nowhere else.
    collateral = json.loads(COLLATERAL_JSON)
    pck_chain = x509.load_pem_x509_certificates(QUOTE[PCK_CHAIN:].rstrip(b"\0"))
    assert [c.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value for c in pck_chain] == [
        "Intel SGX PCK Certificate", "Intel SGX PCK Platform CA", "Intel SGX Root CA"]
    for chain in (pck_chain, *(x509.load_pem_x509_certificates(collateral[k].encode())
                               for k in ("pck_crl_issuer_chain", "tcb_info_issuer_chain", "qe_identity_issuer_chain"))):
        assert chain[-1] == intel_root()


def test_verifying_the_genuine_quote_takes_about_a_millisecond() -> None:
    report, _ = parse_quote(QUOTE)
    policy = _policy().tdx
    times = []
    for _ in range(20):
        start = time.perf_counter()
        verify_tdx(QUOTE, COLLATERAL_JSON.encode(), policy, report.report_data, WHEN)  # type: ignore[arg-type]
        times.append(time.perf_counter() - start)
    assert sorted(times)[len(times) // 2] < 0.05  # measured: 0.6-1 ms (docs/confidential.md)


@pytest.mark.parametrize("offset, check", [
    (HEADER + 10, "signature"),  # the header's QE SVN
    (MRTD, "signature"),  # the TD report body: its MRTD
    (REPORT_DATA, "signature"),  # its report_data
    (SIGNATURE + 3, "signature"),  # the quote's signature
    (ATTESTATION_KEY + 3, "qe"),  # the attestation key: no longer the one the QE report binds
    (QE_REPORT + 100, "qe"),  # the QE's report
    (QE_REPORT + 320, "qe"),  # the QE report's report_data (the hash binding the attestation key)
    (QE_SIGNATURE + 5, "qe"),  # the PCK's signature over the QE report
    (QE_AUTH_DATA, "qe"),  # the QE authentication data the binding hash covers
    (PCK_CHAIN + 200, "chain"),  # the PCK certificate
])
def test_a_flipped_byte_in_the_quote_is_refused_by_its_check(offset: int, check: str) -> None:
    with pytest.raises(AttestationError) as err:
        verify_quote(_flip(QUOTE, offset), COLLATERAL_JSON.encode(), intel_root(), WHEN)
    assert err.value.check == check, str(err.value)
    assert "no hidden state was sent" in str(err.value)


def _hex_flip(value: str, offset: int) -> str:
    return _flip(bytes.fromhex(value), offset).hex()


@pytest.mark.parametrize("field, change, check", [
    ("tcb_info", lambda v: v.replace('"tcbEvaluationDataNumber":17', '"tcbEvaluationDataNumber":18'), "collateral"),
    ("tcb_info", lambda v: v.replace('"UpToDate"', '"OutOfDate"', 1), "collateral"),  # a level's status, unsigned
    ("tcb_info_signature", lambda v: _hex_flip(v, 3), "collateral"),
    ("qe_identity", lambda v: v.replace('"isvprodid":2', '"isvprodid":3'), "collateral"),
    ("qe_identity_signature", lambda v: _hex_flip(v, 3), "collateral"),
    ("pck_crl", lambda v: _hex_flip(v, len(v) // 2 - 5), "collateral"),  # the PCK CRL's signature
    ("root_ca_crl", lambda v: _hex_flip(v, 60), "collateral"),
    # not a TCB signer
    ("tcb_info_issuer_chain", lambda v: json.loads(COLLATERAL_JSON)["pck_crl_issuer_chain"], "chain"),
])
def test_tampered_collateral_is_refused(field: str, change: object, check: str) -> None:
    collateral = json.loads(COLLATERAL_JSON)
    collateral[field] = change(collateral[field])  # type: ignore[operator]
    with pytest.raises(AttestationError) as err:
        verify_quote(QUOTE, json.dumps(collateral).encode(), intel_root(), WHEN)
    assert err.value.check == check, str(err.value)


def test_collateral_is_used_only_inside_its_validity_and_with_intels_root() -> None:
    for when, reason in ((datetime.datetime(2025, 6, 19, 10, tzinfo=datetime.UTC), "issue date is in the future"),
                         (datetime.datetime(2025, 7, 20, tzinfo=datetime.UTC), "TCBInfo expired")):
        with pytest.raises(AttestationError, match=rf"\(collateral\).*{reason}"):
            verify_quote(QUOTE, COLLATERAL_JSON.encode(), intel_root(), when)
    other = x509.load_pem_x509_certificate(
        (Path(__file__).parents[1] / "src/splitllm/attestation/amd/milan/ark.pem").read_bytes()
    )
    with pytest.raises(AttestationError, match=r"\(chain\)"):
        verify_quote(QUOTE, COLLATERAL_JSON.encode(), other, WHEN)


def test_the_td_must_be_one_of_the_policys_images() -> None:
    report, _ = parse_quote(QUOTE)
    policy = _policy().tdx
    assert policy is not None
    image = policy.images[0]
    for changed, check in [
        (dataclasses.replace(image, mrtd=bytes(48)), "measurement"),
        (dataclasses.replace(image, rtmr1=bytes(48)), "measurement"),
        (dataclasses.replace(image, rtmr3=b"\x01" * 48), "measurement"),
    ]:
        with pytest.raises(AttestationError) as err:
            verify_tdx(QUOTE, COLLATERAL_JSON.encode(), dataclasses.replace(policy, images=(changed,)),
                       report.report_data, WHEN)
        assert err.value.check == check
    both = dataclasses.replace(policy, images=(dataclasses.replace(image, mrtd=bytes(48)), image))
    verify_tdx(QUOTE, COLLATERAL_JSON.encode(), both, report.report_data, WHEN)  # any one image is enough
    with pytest.raises(AttestationError, match=r"\(mr_config_id\)"):
        verify_tdx(QUOTE, COLLATERAL_JSON.encode(), _policy(mr_config_ids=["01" * 48]).tdx, report.report_data, WHEN)  # type: ignore[arg-type]
    verify_tdx(QUOTE, COLLATERAL_JSON.encode(), _policy(mr_config_ids=["00" * 48]).tdx, report.report_data, WHEN)  # type: ignore[arg-type]


def test_the_genuine_quote_answers_no_splitllm_handshake() -> None:
    """Its report_data was chosen by whoever made it: any handshake's binding refuses it, after Intel's
    verification passed (a replayed quote)."""
    policy = _policy().tdx
    binding = report_data(bytes(32), bytes(32), "ab" * 32, "5e" * 32, (2, 28), 2)
    with pytest.raises(AttestationError, match=r"\(binding\).*replayed"):
        verify_tdx(QUOTE, COLLATERAL_JSON.encode(), policy, binding, WHEN)  # type: ignore[arg-type]


def test_malformed_tdx_evidence_is_a_named_failure() -> None:
    report, _ = parse_quote(QUOTE)
    policy = _policy().tdx
    cases = [
        (QUOTE, None, "no collateral"),
        (QUOTE, b"{", "collateral is malformed"),
        (QUOTE[:600], COLLATERAL_JSON.encode(), "cannot be parsed"),
        (QUOTE[:4] + b"\x00" + QUOTE[5:], COLLATERAL_JSON.encode(), "cannot be parsed"),  # TEE type SGX: no TD report
    ]
    for quote, collateral, reason in cases:
        with pytest.raises(AttestationError, match=rf"\(evidence\).*{reason}"):
            verify_tdx(quote, collateral, policy, report.report_data, WHEN)  # type: ignore[arg-type]


def test_tdx_policy_sections_are_refused_with_the_reason(tmp_path: Path) -> None:
    image = {"mrtd": "00" * 48, "rtmr0": "00" * 48, "rtmr1": "00" * 48, "rtmr2": "00" * 48}
    cases = [
        ({"platform": "tdx"}, "requirements in a 'tdx' section"),
        ({"tdx": {"measurements": [image]}}, "says \"platform\": \"tdx\""),
        ({"platform": "tdx", "tdx": {"measurements": [image]}, "measurements": ["00" * 48]},
         "measurements do not apply"),
        ({"platform": "tdx", "tdx": {}}, "needs 'measurements'"),
        ({"platform": "tdx", "tdx": {"measurements": [{"mrtd": "00" * 48}]}}, "\"rtmr2\": 96 hex each"),
        ({"platform": "tdx", "tdx": {"measurements": [{**image, "rtmr4": "00"}]}}, "\"rtmr3\" optional"),
        ({"platform": "tdx", "tdx": {"measurements": [{**image, "mrtd": "00"}]}}, "1 bytes, expected 48"),
        ({"platform": "tdx", "tdx": {"measurements": [image], "tcb_statuses": ["SWHardeningNeeded"]}},
         "UpToDate and any"),
        ({"platform": "tdx", "tdx": {"measurements": [image], "tcb_statuses": ["UpToDate", "Revoked"]}},
         "UpToDate and any"),
        ({"platform": "tdx", "tdx": {"measurements": [image], "min_tcb": {}}}, "unknown keys in 'tdx': min_tcb"),
        ({"platform": "tdx", "tdx": {"measurements": [image], "trust_anchor": "intel"}}, "'trust_anchor' is"),
        ({"platform": "tdx", "tdx": {"measurements": [image], "trust_anchor": {"root": "root.pem"}}}, "not Intel's"),
        ({"platform": "sgx"}, "one of sev-snp, tdx"),
    ]
    (tmp_path / "root.pem").write_bytes(
        (Path(__file__).parents[1] / "src/splitllm/attestation/amd/milan/ark.pem").read_bytes()
    )
    for fields, reason in cases:
        with pytest.raises(PolicyError, match=reason):
            AttestationPolicy.from_dict(fields, tmp_path)
    policy = AttestationPolicy.from_dict({"platform": "tdx", "tdx": {"measurements": [image], "tcb_statuses": [
        "UpToDate", "SWHardeningNeeded"]}}, tmp_path)
    assert policy.platform == "tdx" and policy.tdx == TdxPolicy(intel_root(), True, (TdImage(*[bytes(48)] * 4),),
                                                                   frozenset({"UpToDate", "SWHardeningNeeded"}))


class _Pccs(BaseHTTPRequestHandler):
    """Intel's PCS API (v4) for one platform, answering with the genuine collateral's parts."""

    collateral = json.loads(COLLATERAL_JSON)
    asked: list[str] = []

    def do_GET(self) -> None:
        self.asked.append(self.path)
        c, path = self.collateral, urllib.parse.urlparse(self.path).path
        answers = {
            "/sgx/certification/v4/pckcrl": (bytes.fromhex(c["pck_crl"]), "SGX-PCK-CRL-Issuer-Chain",
                                             "pck_crl_issuer_chain"),
            "/sgx/certification/v4/rootcacrl": (c["root_ca_crl"].encode(), None, None),  # a PCCS sends it in hex
            "/tdx/certification/v4/tcb": (
                f'{{"tcbInfo":{c["tcb_info"]},"signature":"{c["tcb_info_signature"]}"}}'.encode(),
                "TCB-Info-Issuer-Chain", "tcb_info_issuer_chain"),
            "/tdx/certification/v4/qe/identity": (
                f'{{"enclaveIdentity":{c["qe_identity"]},"signature":"{c["qe_identity_signature"]}"}}'.encode(),
                "SGX-Enclave-Identity-Issuer-Chain", "qe_identity_issuer_chain"),
        }
        if path not in answers:
            self.send_error(404)
            return
        body, header, chain = answers[path]
        self.send_response(200)
        if header:
            self.send_header(header, urllib.parse.quote(c[chain]))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def pccs() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Pccs)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Pccs.asked.clear()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


class _RecordedQuote:
    """The genuine quote where configfs-tsm would make one (it cannot carry a new report_data)."""

    def report(self, report_data: bytes) -> tuple[bytes, dict[str, bytes]]:
        return QUOTE, {}


def test_the_server_sends_the_collateral_it_fetched_and_the_client_verifies_it_offline(pccs: str) -> None:
    attester = TdxAttester(_RecordedQuote(), pccs)
    quote, certs = attester.report(bytes(64))
    assert sorted(urllib.parse.urlparse(p).path for p in _Pccs.asked) == [
        "/sgx/certification/v4/pckcrl", "/sgx/certification/v4/rootcacrl", "/tdx/certification/v4/qe/identity",
        "/tdx/certification/v4/tcb"]
    assert "fmspc=B0C06F000000" in " ".join(_Pccs.asked)  # the platform's, read from the quote's PCK certificate
    report, _ = parse_quote(quote)
    verified = verify_tdx(quote, certs[COLLATERAL], _policy().tdx, report.report_data, WHEN)  # type: ignore[arg-type]
    assert verified.status == "UpToDate"
    attester.report(bytes(64))  # this collateral expired in 2025: the server fetches it again
    assert len(_Pccs.asked) == 8


def test_a_server_whose_pccs_does_not_answer_has_no_evidence(pccs: str) -> None:
    with pytest.raises(OSError, match="no TDX collateral from"):
        TdxAttester(_RecordedQuote(), pccs + "/nowhere").report(bytes(64))


# The simulated vendor: the same quote layout, the same verification (dcap-qvl's, under the simulated
# root), the same handshake. What it proves is the wiring; a simulated root protects nothing.

FINGERPRINT = "ab" * 32
WEIGHTS = "5e" * 32
LAYERS = (2, 28)
VERSION = 2


@pytest.fixture(scope="module")
def tdx_vendor(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tdx-vendor")
    tdx_sim_init(folder)
    return folder


def _handshake(vendor: Path, policy: AttestationPolicy | None = None, **claims: object) -> tuple:
    """One attest round trip between a client handshake and `answer` (claims override the server's)."""
    policy = policy or AttestationPolicy.load(vendor / "policy.json")
    client = ClientHandshake(policy, FINGERPRINT, LAYERS, VERSION)
    server = dict(fingerprint=FINGERPRINT, weights=WEIGHTS, layers=LAYERS, version=VERSION) | claims
    evidence, server_channel = answer(client.request(1), SimulatedTdx(vendor), **server)  # type: ignore[arg-type]
    return client, Evidence.from_header(evidence.header(1)), server_channel


def test_simulated_tdx_evidence_passes_the_same_verifier_and_opens_a_sealed_channel(tdx_vendor: Path) -> None:
    client, evidence, server_channel = _handshake(tdx_vendor)
    assert evidence.platform == "tdx" and set(evidence.certs) == {COLLATERAL}
    channel, verified = client.finish(evidence)
    assert isinstance(verified, TdxVerified) and verified.simulated and verified.status == "UpToDate"
    assert verified.report.report_data == report_data(client.nonce, evidence.server_key, FINGERPRINT, WEIGHTS, LAYERS,
                                                      VERSION)
    assert server_channel.open(channel.seal(b"open")) == b"open"
    assert channel.open(server_channel.seal(b"opened")) == b"opened"


def test_replayed_relayed_or_foreign_tdx_evidence_is_refused(tdx_vendor: Path, vendor: Path) -> None:
    client, evidence, _ = _handshake(tdx_vendor)
    replay = ClientHandshake(client.policy, FINGERPRINT, LAYERS, VERSION)  # a new handshake, an old quote
    intruder = _raw(X25519PrivateKey.generate().public_key())  # an honest quote under a man in the middle's key
    policy = client.policy
    cases = [
        (replay, evidence, "binding"),
        (client, dataclasses.replace(evidence, server_key=intruder), "binding"),
        (client, dataclasses.replace(evidence, certs={}), "evidence"),
        (client, dataclasses.replace(evidence, report=_flip(evidence.report, MRTD)), "signature"),
        (ClientHandshake(dataclasses.replace(policy,
                                             tdx=dataclasses.replace(policy.tdx, root=intel_root(), pinned=True)),
                         FINGERPRINT, LAYERS, VERSION), evidence, "chain"),  # simulated evidence, Intel's root
        (client, dataclasses.replace(evidence, weights="cd" * 32), "binding"),  # other weights than the quote binds
        # SEV-SNP's
        (client, answer(client.request(1), SimulatedSnp(vendor), FINGERPRINT, WEIGHTS, LAYERS, VERSION)[0], "platform"),
    ]
    for handshake, offered, check in cases:
        with pytest.raises(AttestationError) as err:
            handshake.finish(offered)
        assert err.value.check == check, (check, str(err.value))


def test_the_tcb_status_floor_and_the_tds_attributes(tmp_path: Path) -> None:
    tdx_sim_init(tmp_path / "outdated", tcb_status="OutOfDate")
    client, evidence, _ = _handshake(tmp_path / "outdated")
    with pytest.raises(AttestationError, match=r"\(tcb\).*OutOfDate; the policy accepts UpToDate"):
        client.finish(evidence)
    policy = AttestationPolicy.load(tmp_path / "outdated" / "policy.json")
    lenient = dataclasses.replace(policy,
                                  tdx=dataclasses.replace(policy.tdx,
                                                          tcb_statuses=frozenset({"UpToDate", "OutOfDate"})))
    client, evidence, _ = _handshake(tmp_path / "outdated", lenient)
    assert client.finish(evidence)[1].status == "OutOfDate"  # type: ignore[union-attr]
    tdx_sim_init(tmp_path / "hardening", tcb_status="SWHardeningNeeded")
    client, evidence, _ = _handshake(tmp_path / "hardening")
    with pytest.raises(AttestationError, match=r"\(tcb\).*SWHardeningNeeded"):
        client.finish(evidence)
    tdx_sim_init(tmp_path / "debug", debug=True)
    client, evidence, _ = _handshake(tmp_path / "debug")
    with pytest.raises(AttestationError, match=r"\(debug\)"):  # whatever the policy: its host can read its memory
        client.finish(evidence)


def test_an_attested_td_running_another_image_or_model_is_refused(tdx_vendor: Path) -> None:
    policy = AttestationPolicy.load(tdx_vendor / "policy.json")
    assert policy.tdx is not None
    other = dataclasses.replace(policy, tdx=dataclasses.replace(policy.tdx, images=(
        dataclasses.replace(policy.tdx.images[0], mrtd=bytes(48)),)))
    pinned = dataclasses.replace(policy, weights=frozenset({bytes.fromhex(WEIGHTS)}))
    for changed, claims, check in ((other, {}, "measurement"), (policy, {"fingerprint": "cd" * 32}, "model"),
                                   (policy, {"layers": (3, 28)}, "split"), (pinned, {"weights": "cd" * 32}, "weights"),
                                   (dataclasses.replace(policy, weights=frozenset({b"\x01" * 32})), {}, "weights")):
        client, evidence, _ = _handshake(tdx_vendor, changed, **claims)
        with pytest.raises(AttestationError) as err:
            client.finish(evidence)
        assert err.value.check == check
    client, evidence, _ = _handshake(tdx_vendor, pinned)
    client.finish(evidence)  # the weights the policy names, on TDX as on SEV-SNP


def test_a_tdx_policy_names_weights_beside_its_tdx_section(tdx_vendor: Path) -> None:
    """`weights` names what the server loaded, not anything of the platform: a TDX policy gives it at the top
    level, parsed as strictly as an SEV-SNP policy's, and never inside `tdx`."""
    data = json.loads((tdx_vendor / "policy.json").read_text())
    policy = AttestationPolicy.from_dict({**data, "weights": [WEIGHTS]}, tdx_vendor)
    assert policy.platform == "tdx" and policy.weights == frozenset({bytes.fromhex(WEIGHTS)})
    assert AttestationPolicy.from_dict(data, tdx_vendor).weights is None
    cases = [
        ({**data, "weights": WEIGHTS}, "'weights' must be a list of hex strings"),
        ({**data, "weights": [None]}, "'weights' must be a list of hex strings"),
        ({**data, "weights": ["5e" * 31]}, "31 bytes, expected 32"),
        ({**data, "weights": ["zz" * 32]}, "is not hex"),
        ({**data, "tdx": {**data["tdx"], "weights": [WEIGHTS]}}, "unknown keys in 'tdx': weights"),
    ]
    for fields, reason in cases:
        with pytest.raises(PolicyError, match=re.escape(reason)):
            AttestationPolicy.from_dict(fields, tdx_vendor)


def test_tdx_policy_sections_are_parsed_strictly(tmp_path: Path) -> None:
    """The `tdx` section obeys the same rules as an SEV-SNP policy: no key twice, no unknown key, every
    value exactly its type, and a trust anchor that is Intel's root or plainly a simulated vendor."""
    image = {"mrtd": "00" * 48, "rtmr0": "00" * 48, "rtmr1": "00" * 48, "rtmr2": "00" * 48}
    doubled = tmp_path / "doubled.json"
    doubled.write_text('{"platform": "tdx", "tdx": {"measurements": [' + json.dumps(image) + '], '
                       '"tcb_statuses": ["UpToDate", "OutOfDate"], "tcb_statuses": ["UpToDate"]}}')
    with pytest.raises(PolicyError, match="doubled.json: key 'tcb_statuses' is given twice"):
        AttestationPolicy.load(doubled)
    inner = tmp_path / "inner.json"
    inner.write_text('{"platform": "tdx", "tdx": {"measurements": [{"mrtd": "' + "00" * 48 + '", "mrtd": "' + "11" * 48
                     + '", "rtmr0": "' + "00" * 48 + '", "rtmr1": "' + "00" * 48
                     + '", "rtmr2": "' + "00" * 48 + '"}]}}')
    with pytest.raises(PolicyError, match="key 'mrtd' is given twice"):
        AttestationPolicy.load(inner)
    impostor_key = ec.generate_private_key(ec.SECP384R1())
    impostor = (x509.CertificateBuilder().subject_name(intel_root().subject).issuer_name(intel_root().subject)
                .public_key(impostor_key.public_key()).serial_number(1).not_valid_before(WHEN)
                .not_valid_after(WHEN + datetime.timedelta(days=1)).sign(impostor_key, hashes.SHA256()))
    (tmp_path / "impostor.pem").write_bytes(impostor.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "intel.pem").write_bytes(intel_root().public_bytes(serialization.Encoding.PEM))
    tdx = {"measurements": [image]}
    cases = [
        ({"platform": "tdx", "tdx": tdx, "simulated": "yes"}, "'simulated' must be true or false"),
        ({"platform": "tdx", "tdx": tdx, "min_tcb": {}}, "min_tcb do not apply"),
        ({"platform": "tdx", "tdx": [tdx]}, "'tdx' must be a JSON object"),
        ({"platform": "tdx", "tdx": {**tdx, "tcb_statuses": "UpToDate"}}, "UpToDate and any"),
        ({"platform": "tdx", "tdx": {**tdx, "tcb_statuses": [["UpToDate"]]}}, "UpToDate and any"),
        ({"platform": "tdx", "tdx": {**tdx, "mr_config_ids": None}}, "'mr_config_ids' must be a list of hex strings"),
        ({"platform": "tdx", "tdx": {**tdx, "mr_config_ids": "00" * 48}},
         "'mr_config_ids' must be a list of hex strings"),
        ({"platform": "tdx", "tdx": {**tdx, "mr_config_ids": ["zz" * 48]}}, "is not hex"),
        ({"platform": "tdx", "tdx": {**tdx, "mr_config_ids": ["00" * 32]}}, "32 bytes, expected 48"),
        ({"platform": "tdx", "tdx": {"measurements": [{**image, "rtmr1": 0}]}}, "'rtmr1' must be a hex string"),
        ({"platform": "tdx", "tdx": {"measurements": image}}, "needs 'measurements'"),
        ({"platform": "tdx", "tdx": {**tdx, "trust_anchor": None}}, "'trust_anchor' is"),
        ({"platform": "tdx", "tdx": {**tdx, "trust_anchor": {"root": 1}}}, "'trust_anchor' is"),
        ({"platform": "tdx", "tdx": {**tdx, "trust_anchor": {"root": "impostor.pem"}}, "simulated": True},
         "bears the name of Intel's SGX root but is not that root"),
        ({"platform": "tdx", "tdx": tdx, "simulated": True}, "never both"),
        ({"platform": "tdx", "tdx": {**tdx, "trust_anchor": {"root": "intel.pem"}}, "simulated": True}, "never both"),
        ({"platform": ["tdx"], "tdx": tdx}, "one of sev-snp, tdx"),
    ]
    for fields, reason in cases:
        with pytest.raises(PolicyError, match=re.escape(reason)):
            AttestationPolicy.from_dict(fields, tmp_path)
    from_file = AttestationPolicy.from_dict({"platform": "tdx", "tdx": {**tdx, "trust_anchor": {"root": "intel.pem"}}},
                                            tmp_path)
    assert from_file.tdx is not None and from_file.tdx.pinned and not from_file.simulated


def test_a_simulated_intel_root_needs_a_policy_that_says_so(tdx_vendor: Path) -> None:
    data = json.loads((tdx_vendor / "policy.json").read_text())
    del data["simulated"]
    with pytest.raises(PolicyError, match="not Intel's"):
        AttestationPolicy.from_dict(data, tdx_vendor)
    assert load_attester("simulated", str(tdx_vendor)).platform == "tdx"  # type: ignore[union-attr]


def test_the_tdx_handshake_over_loopback_gives_the_plain_output(  # type: ignore[no-untyped-def]
    tdx_vendor: Path, server, load_client_model, tiny_models
) -> None:
    """A real server on loopback serving the simulated TD's evidence, and a client that verifies it
    before its first hidden state: the same tokens as the plain server's."""
    from protocol_client import greedy
    from splitllm.client.connection import ConnectionOptions
    from splitllm.client.remote import RemoteMiddle

    client_model = load_client_model(tiny_models["llama"], 1, 1)
    plain = server(tiny_models["llama"], 1, 1).url
    sealed_thread = server(tiny_models["llama"], 1, 1, attestation="simulated", attestation_sim=str(tdx_vendor))
    sealed = sealed_thread.url
    prompt = [1, 5, 9, 13, 17]

    def run(url: str, policy: AttestationPolicy | None) -> list[int]:
        options = ConnectionOptions(attestation=policy, deadline_s=30)
        middle = RemoteMiddle(url, client_model.files.fingerprint, client_model.middle_range, "float32", 64, options)
        return greedy(client_model, middle, prompt, 6)

    policy = AttestationPolicy.load(tdx_vendor / "policy.json")
    assert run(sealed, policy) == run(plain, None)
    loaded = bytes.fromhex(sealed_thread.server.loaded_fingerprint)  # what the quote binds: the bytes it loaded
    assert run(sealed, dataclasses.replace(policy, weights=frozenset({loaded}))) == run(plain, None)
    with pytest.raises(AttestationError, match=r"\(weights\)"):  # a policy naming other weights
        run(sealed, dataclasses.replace(policy, weights=frozenset({bytes(32)})))
    with pytest.raises(AttestationError, match=r"\(evidence\)"):  # a TDX policy, a plain server
        run(plain, AttestationPolicy.load(tdx_vendor / "policy.json"))
