"""The confidential server over real sockets, attacked by the project's own audit.

A malicious server in the middle (`Relay`) records every byte a client sends it and may rewrite what
it answers. For each way attestation can fail, the client raises an error naming the check and the
recording holds nothing but the handshake: the white-box inversion that reads a plain split's
states recovers no token from it. With a server that passes, the output equals the plain run's and
the recording is ciphertext. The simulated vendor stands in for AMD's (no SEV-SNP machine here);
the verifier is the one genuine evidence goes through (tests/test_attestation.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect
from websockets.sync.server import ServerConnection, serve

from conftest import CHAT_CASES, DEFAULT_SPLIT, TINY_SPLIT
from protocol_client import greedy
from typer.testing import CliRunner

from splitllm.cli import app
from splitllm.client.client import SplitClient
from splitllm.client.client_model import ClientModel
from splitllm.model.precision import Precision
from splitllm.protocol import wire
from splitllm.attestation.handshake import ClientHandshake, _raw
from splitllm.attestation.policy import AttestationPolicy
from splitllm.attestation.sealing import SealError
from splitllm.attestation.simulation import sim_init
from splitllm.attestation.verify import AttestationError
from splitllm.client.connection import ConnectionOptions
from splitllm.client.remote import RemoteMiddle
from splitllm.lab.privacy.attacks.whitebox import LanguageModelPrior, invert
from splitllm.lab.privacy.states import PublicModel
from splitllm.protocol.messages import PROTOCOL_VERSION
from splitllm.protocol.wire import ProtocolError
from splitllm.server.app import MiddleServer
from splitllm.server.settings import ServerSettings
from splitllm.testing.launch import ServerThread
from splitllm.weights.conversions import StoredWeights
from splitllm.weights.sources import ModelFiles

FIRST, LAST = DEFAULT_SPLIT
PROMPT = "My name is Alice Smith and my bank PIN is 4921."
NEW_TOKENS = 8


Rewrite = Callable[[int, bytes], bytes]


class Relay:
    """A malicious server: records every message it receives, relays `forward(index, message)` to
    `target` and answers with `rewrite(index, reply)` (the index counts messages over every connection)."""

    def __init__(self, target: str, rewrite: Rewrite | None = None, forward: Rewrite | None = None) -> None:
        self.target = target.rstrip("/") + "/ws"
        self.rewrite = rewrite or (lambda _, reply: reply)
        self.forward = forward or (lambda _, message: message)
        self.received: list[bytes] = []
        self.connections = 0
        self._server = serve(self._handle, "127.0.0.1", 0, compression=None, max_size=None)
        self.url = f"ws://127.0.0.1:{self._server.socket.getsockname()[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def _handle(self, client: ServerConnection) -> None:
        self.connections += 1
        with connect(self.target, compression=None, max_size=None) as upstream:
            try:
                for message in client:
                    index = len(self.received)
                    self.received.append(bytes(message))  # type: ignore[arg-type]
                    upstream.send(self.forward(index, message))  # type: ignore[arg-type]
                    client.send(self.rewrite(index, upstream.recv(timeout=60)))
            except ConnectionClosed:
                pass

    def close(self) -> None:
        self._server.shutdown()


@pytest.fixture
def relay() -> Iterator[Callable[..., Relay]]:
    made: list[Relay] = []

    def make(target: str, rewrite: Rewrite | None = None, forward: Rewrite | None = None) -> Relay:
        made.append(Relay(target, rewrite, forward))
        return made[-1]

    yield make
    for r in made:
        r.close()


@pytest.fixture(scope="module")
def prompt(default_files) -> list[int]:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_files.path)(PROMPT)["input_ids"]


@pytest.fixture(scope="module")
def attacker(default_files) -> Callable[[list[bytes], list[int]], int]:  # type: ignore[no-untyped-def]
    """How many prompt tokens the white-box inversion reads off the step frames of a recording."""
    model = PublicModel(default_files, [FIRST])

    def recovered(recording: list[bytes], prompt: list[int]) -> int:
        states = []
        for message in recording:
            try:
                frame = wire.decode(message)
            except ProtocolError:
                continue  # not a frame: ciphertext
            if frame.header.get("op") == "step" and frame.tensor is not None:
                states.append(frame.tensor[: len(prompt) - len(states)])
            if sum(len(s) for s in states) >= len(prompt):
                break
        if not states:
            return 0
        targets = torch.cat(states)
        prior = LanguageModelPrior(model, len(targets))

        def proposals(t: int, seen: list[int]) -> list[torch.Tensor]:
            return [prior.extend(seen[-1], t - 1) if t else -torch.arange(model.cfg.vocab_size, dtype=torch.float32)]

        tokens = invert(model.stack.upto(FIRST), model.embed, targets, proposals).tokens
        return sum(a == b for a, b in zip(tokens, prompt))

    return recovered


def _op(message: bytes) -> str | None:
    """The op of a plain frame; None for anything else (ciphertext)."""
    try:
        return wire.decode(message).header["op"]
    except ProtocolError:
        return None


def _policy(vendor: Path, folder: Path, **changes: object) -> AttestationPolicy:
    data = json.loads((vendor / "policy.json").read_text()) | changes
    if "trust_anchors" not in changes:  # keep pointing at the simulated vendor's files
        data["trust_anchors"] = [{**a, "ark": str(vendor / a["ark"]),
                                  "ask": str(vendor / a["ask"])} for a in data["trust_anchors"]]
    (folder / "policy.json").write_text(json.dumps(data))
    return AttestationPolicy.load(folder / "policy.json")


def _run(client_model, url: str, prompt: list[int],  # type: ignore[no-untyped-def]
         policy: AttestationPolicy | None) -> list[int]:
    options = ConnectionOptions(attestation=policy, deadline_s=5)
    middle = RemoteMiddle(url, client_model.files.fingerprint, client_model.middle_range, "float16", 64, options)
    return greedy(client_model, middle, prompt, NEW_TOKENS)


@pytest.mark.slow
def test_an_attested_server_gives_the_plain_output_and_the_wire_carries_only_ciphertext(
    server, load_client_model, relay, vendor, prompt, attacker, default_files
) -> None:  # type: ignore[no-untyped-def]
    client_model = load_client_model(None, FIRST, LAST)
    plain = relay(server(None, FIRST, LAST).url)
    sealed = relay(server(None, FIRST, LAST, attestation="simulated", attestation_sim=str(vendor)).url)
    expected = _run(client_model, plain.url, prompt, None)
    assert _run(client_model, sealed.url, prompt, AttestationPolicy.load(vendor / "policy.json")) == expected
    # The audit has teeth: the same attack reads the plain split's prompt off its recording.
    assert attacker(plain.received, prompt) >= 0.9 * len(prompt)
    assert [_op(m) for m in sealed.received] == ["attest"] + [None] * (len(sealed.received) - 1)
    assert attacker(sealed.received, prompt) == 0
    assert len(sealed.received) == len(plain.received) + 1  # the handshake; every other message sealed


def _evidence_of_another_handshake(url: str, vendor: Path, files) -> bytes:  # type: ignore[no-untyped-def]
    """An honest evidence frame, recorded from an earlier handshake, for a replay."""
    hs = ClientHandshake(AttestationPolicy.load(vendor / "policy.json"), files.fingerprint, (FIRST, 30 - LAST),
                         PROTOCOL_VERSION)
    with connect(url + "/ws", compression=None) as ws:
        ws.send(wire.encode(hs.request(1)))
        return ws.recv(timeout=30)  # type: ignore[return-value]


def _with_intruders_key(index: int, reply: bytes) -> bytes:
    frame = wire.decode(reply)
    return wire.encode({**frame.header, "key": _raw(X25519PrivateKey.generate().public_key())}) if index == 0 else reply


@pytest.mark.slow
def test_every_failed_check_sends_no_state(
    server, load_client_model, relay, vendor, prompt, attacker, default_files, tiny_models, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    client_model = load_client_model(None, FIRST, LAST)
    honest = server(None, FIRST, LAST, attestation="simulated", attestation_sim=str(vendor)).url
    debug_vendor = tmp_path / "debug"
    sim_init(debug_vendor, debug=True)
    replayed = _evidence_of_another_handshake(honest, vendor, default_files)
    trusted = AttestationPolicy.load(vendor / "policy.json")
    measurement = json.loads((vendor / "policy.json").read_text())["measurements"]
    cases = [
        ("evidence", server(None, FIRST, LAST).url, trusted, None),
        ("measurement", honest, _policy(vendor, tmp_path, measurements=["00" * 48]), None),
        ("debug", server(None, FIRST, LAST, attestation="simulated", attestation_sim=str(debug_vendor)).url,
         AttestationPolicy.load(debug_vendor / "policy.json"), None),
        ("tcb", honest, _policy(vendor, tmp_path, min_tcb={"milan": {"microcode": 230}}), None),
        ("chain", honest,
         _policy(vendor, tmp_path, trust_anchors=["amd-milan"], simulated=False, measurements=measurement), None),
        ("binding", honest, trusted, lambda i, reply: replayed if i == 0 else reply),
        ("binding", honest, trusted, _with_intruders_key),
        ("model", server(tiny_models["llama"], 1, 1, attestation="simulated", attestation_sim=str(vendor)).url, trusted,
         None),
        ("split", server(None, FIRST + 1, LAST, attestation="simulated", attestation_sim=str(vendor)).url, trusted,
         None),
    ]
    for check, url, policy, rewrite in cases:
        mitm = relay(url, rewrite)
        with pytest.raises(AttestationError) as err:
            _run(client_model, mitm.url, prompt, policy)
        assert err.value.check == check, (check, err.value)
        assert [_op(m) for m in mitm.received] == ["attest"], check
        assert attacker(mitm.received, prompt) == 0


def _flip_one_byte(path: Path, tensor: str) -> None:
    """Change one byte of `tensor`'s data in a safetensors file, then put the file's times back (its size
    never changed): what a host that keeps a digest cache keyed by size and time would not notice."""
    before = path.stat()
    data = bytearray(path.read_bytes())
    header = int.from_bytes(data[:8], "little")
    begin, _ = json.loads(data[8 : 8 + header])[tensor]["data_offsets"]
    data[8 + header + begin] ^= 0x01
    path.write_bytes(bytes(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["float32-none", "bfloat16-int8"])
def test_a_server_whose_loaded_weights_differ_by_one_byte_is_refused(
    setting, tiny_models, vendor, relay, random_ids, tmp_path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """The policy names the loaded-weights fingerprint `splitllm attest weights` computes from the
    writer's own copy. The server's copy then differs by one byte of a middle layer: the checkpoint in
    the exact mode, the converted layer file otherwise. Its model fingerprint (its own account) stays
    the same, the bytes it loaded do not, and the client refuses it with nothing sent but the handshake."""
    precision = Precision.from_name(setting)
    first, last = TINY_SPLIT
    args = ["attest", "weights", "--model", str(tiny_models["llama"]), "--first", str(first), "--last", str(last),
            "--dtype", precision.dtype_name, "--quant", precision.quant]
    result = CliRunner().invoke(app, args, env={"SPLITLLM_CACHE": str(tmp_path / "writer")})
    assert result.exit_code == 0, result.output
    expected = result.stdout.split()[-1]
    policy = _policy(vendor, tmp_path, weights=[expected])

    monkeypatch.setenv("SPLITLLM_CACHE", str(tmp_path / "server"))
    model = Path(shutil.copytree(tiny_models["llama"], tmp_path / "llama"))
    settings = ServerSettings(first=first, last=last, dtype=precision.dtype, quant=precision.quant,
                              attestation="simulated", attestation_sim=str(vendor))
    honest = MiddleServer(str(model), settings)
    assert honest.loaded_fingerprint == expected
    if precision.exact:
        _flip_one_byte(model / "model.safetensors", "model.layers.1.mlp.down_proj.weight")
    else:
        folder = StoredWeights(honest.files, precision, ()).folder
        _flip_one_byte(folder / "layer-0001.safetensors", "model.layers.1.mlp.down_proj.weight::q")
    tampered = MiddleServer(str(model), settings)
    assert tampered.fingerprint == honest.fingerprint and tampered.loaded_fingerprint != expected

    client_model = ClientModel(ModelFiles(tiny_models["llama"]), first, last)  # the client's own copy
    options = ConnectionOptions(attestation=policy, deadline_s=5)
    prompt = random_ids(6, seed=5)
    with ServerThread(honest) as good, ServerThread(tampered) as bad:
        accepted = relay(good.url)
        middle = RemoteMiddle(accepted.url, client_model.files.fingerprint, client_model.middle_range, "float32", 64,
                              options)
        assert len(greedy(client_model, middle, prompt, 4)) == 4
        assert [_op(m) for m in accepted.received] == ["attest"] + [None] * (len(accepted.received) - 1)
        refused = relay(bad.url)
        with pytest.raises(AttestationError) as err:
            RemoteMiddle(refused.url, client_model.files.fingerprint, client_model.middle_range, "float32", 64, options)
    assert err.value.check == "weights" and "no hidden state was sent" in str(err.value)
    assert [_op(m) for m in refused.received] == ["attest"]
    steps = tampered.metrics.total("splitllm_steps_total")
    opened = tampered.metrics.total("splitllm_sessions_opened_total")
    assert (steps, opened, len(tampered.sessions)) == (0, 0, 0)  # the server saw no session and no step


@pytest.mark.slow
def test_tampered_and_replayed_frames_are_refused(  # type: ignore[no-untyped-def]
    server, load_client_model, relay, vendor, prompt
) -> None:
    client_model = load_client_model(None, FIRST, LAST)
    url = server(None, FIRST, LAST, attestation="simulated", attestation_sim=str(vendor)).url
    policy = AttestationPolicy.load(vendor / "policy.json")
    expected = _run(client_model, relay(url).url, prompt, policy)

    def flip(message: bytes) -> bytes:
        return message[:-1] + bytes([message[-1] ^ 1])

    # A reply altered or replayed on its way to the client: refused there, with the reason, never retried.
    for rewrite, check in ((lambda i, r: flip(r) if i == 2 else r, "tampered"), (None, "replayed")):
        mitm = relay(url, rewrite)
        if rewrite is None:
            first: list[bytes] = []
            mitm.rewrite = lambda i, r, first=first: (first.append(r) or r) if i == 1 else first[0] if i == 2 else r
        with pytest.raises(SealError) as err:
            _run(client_model, mitm.url, prompt, policy)
        assert err.value.check == check
    # A request altered on its way to the server: it drops the connection; the client attests again.
    mitm = relay(url, forward=lambda i, m: flip(m) if i == 2 else m)
    options = ConnectionOptions(attestation=policy, deadline_s=30)
    middle = RemoteMiddle(mitm.url, client_model.files.fingerprint, client_model.middle_range, "float16", 64, options)
    assert greedy(client_model, middle, prompt, NEW_TOKENS) == expected
    assert middle.reconnects == 1
    assert mitm.connections == 2 and [_op(m) for m in mitm.received].count("attest") == 2  # attested afresh


@pytest.mark.slow
def test_the_commands_refuse_without_evidence(server, tmp_path, vendor) -> None:  # type: ignore[no-untyped-def]
    cli = [sys.executable, "-m", "splitllm.cli"]
    out = subprocess.run([*cli, "serve", "--attestation", "sev-snp"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1].startswith(
        "error: neither /sys/kernel/config/tsm"
    )
    plain = server(None, FIRST, LAST).url
    out = subprocess.run(
        [*cli, "generate", "--server", plain, "--attestation-policy", str(vendor / "policy.json"), "--max-new-tokens",
         "4", "hi"],
        capture_output=True, text=True, timeout=300,
    )
    assert (
        out.returncode == 1
        and "attestation failed (evidence)" in out.stderr
        and "no hidden state was sent" in out.stderr
    )
    assert "SIMULATED vendor" in out.stderr


@pytest.mark.parametrize("case", CHAT_CASES)
def test_the_python_apis_take_a_policy(server, vendor, chat_split, case) -> None:  # type: ignore[no-untyped-def]
    """The attested handshake and sealed steps end to end through both Python APIs: the plain output."""
    from splitllm.api.hf import SplitModelForCausalLM

    model, first, last = chat_split(case)
    sealed = server(model, first, last, attestation="simulated", attestation_sim=str(vendor)).url
    plain = server(model, first, last).url
    policy = vendor / "policy.json"
    want = SplitClient(model, plain, first, last).generate(PROMPT, NEW_TOKENS)
    attested_client = SplitClient(model, sealed, first, last, attestation_policy=policy)
    assert attested_client.generate(PROMPT, NEW_TOKENS).ids == want.ids
    ids = [want.prompt_ids]
    hf = SplitModelForCausalLM.from_pretrained(model, plain, first, last).generate(ids, max_new_tokens=6)
    attested = SplitModelForCausalLM.from_pretrained(model, sealed, first, last, attestation_policy=policy)
    assert torch.equal(attested.generate(ids, max_new_tokens=6), hf)
    with pytest.raises(ValueError, match="needs a server URL"):
        SplitModelForCausalLM.from_pretrained(model, None, first, last, attestation_policy=policy)
