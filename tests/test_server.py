"""The server over real loopback sockets: what it loads, how it refuses bad requests (a clear error
frame, with the session and the server left intact), and isolation between sessions."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
from conftest import DEFAULT_SPLIT
from protocol_client import RawClient
from safetensors import safe_open

from splitllm.protocol import messages, wire
from splitllm.protocol.messages import (
    PROTOCOL_VERSION, ClosedMessage, ErrorMessage, OpenedMessage, OpenMessage, ResultMessage, StepMessage,
)
from splitllm.client.pipeline import SplitPipeline
from splitllm.client.client import SplitClient
from splitllm.testing.launch import ServerThread
from splitllm.model.precision import EXACT
from splitllm.decoding.sequential import decode_sequential
from splitllm.weights.sources import ModelFiles
from splitllm.server.app import MiddleServer
from splitllm.server.settings import ServerSettings
from splitllm.stats import StepTiming
from splitllm.model.stage import Step

FIRST, LAST = DEFAULT_SPLIT
CONTEXT = 64
HIDDEN = 576  # the default model's hidden size
PROMPT = "Name three colors of the rainbow and say one thing about each."


# --- what the server holds ------------------------------------------------------------------------------


@pytest.mark.slow
def test_server_holds_only_the_middle_layers(default_files, tensor_reads) -> None:
    names = tensor_reads
    server = MiddleServer(None, ServerSettings(first=FIRST, last=LAST, dtype=torch.float32))  # the checkpoint's tensors
    cfg = default_files.config
    middle = range(FIRST, cfg.num_layers - LAST)
    assert names and {int(n.split(".")[2]) for n in names} == set(middle)
    assert all(n.startswith("model.layers.") for n in names)
    stage = server.stage
    assert (stage.start, stage.end, len(stage.layers)) == (FIRST, cfg.num_layers - LAST, len(middle))
    shapes = {tuple(p.shape) for p in stage.parameters()}
    assert not any(cfg.vocab_size in s for s in shapes)  # no embedding or LM head
    per_layer = sum(p.numel() for p in stage.layers[0].parameters())
    assert sum(p.numel() for p in stage.parameters()) == per_layer * len(middle)
    in_files = set()
    for file in default_files.weight_files:  # every shard the conversion wrote, whatever their layout
        with safe_open(file, framework="pt") as weights:
            in_files |= set(weights.keys())
    assert set(names) == {n for n in in_files if n.startswith("model.layers.") and int(n.split(".")[2]) in middle}


def test_server_reads_middle_biases_only(tiny_models, tensor_reads) -> None:
    names = tensor_reads
    MiddleServer(str(tiny_models["qwen2"]), ServerSettings(first=1, last=1, dtype=torch.float32))
    assert {int(n.split(".")[2]) for n in names} == {1, 2}
    assert "model.layers.1.self_attn.q_proj.bias" in names
    assert not any("embed" in n or "lm_head" in n or n == "model.norm.weight" for n in names)


@pytest.mark.slow
@pytest.mark.parametrize(("first", "last"), [(0, 2), (2, -1), (20, 10), (29, 1), (30, 0)])
def test_invalid_split_is_refused_naming_the_layer_count(first: int, last: int) -> None:
    with pytest.raises(ValueError, match="the model has 30 layers"):
        MiddleServer(None, ServerSettings(first=first, last=last))


# --- opening sessions -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_url(server) -> str:
    return server(None, FIRST, LAST).url


def _open_header(files: ModelFiles, **override: object) -> dict:
    header = {
        "op": "open",
        "id": 1,
        "version": PROTOCOL_VERSION,
        "fingerprint": files.fingerprint,
        "layers": [FIRST, files.config.num_layers - LAST],
        "dtype": "float32",
        "max_context": CONTEXT,
    }
    return {**header, **override}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("override", "code"),
    [
        ({"fingerprint": "0" * 64}, "model_mismatch"),
        ({"fingerprint": None}, "model_mismatch"),
        ({"layers": [1, 28]}, "split_mismatch"),
        ({"layers": [2, 27]}, "split_mismatch"),
        ({"version": PROTOCOL_VERSION + 1}, "version_mismatch"),
        ({"version": None}, "version_mismatch"),
        ({"dtype": "int8"}, "bad_dtype"),
        ({"max_context": 0}, "bad_request"),
        ({"max_context": "big"}, "bad_request"),
    ],
)
def test_bad_open_is_refused_and_connection_stays_usable(default_url, default_files, override, code) -> None:
    with RawClient(default_url) as raw:
        refused = raw.request(_open_header(default_files, **override))
        assert isinstance(refused, ErrorMessage) and (refused.code, refused.id) == (code, 1) and refused.message
        opened = raw.request(_open_header(default_files))
        assert isinstance(opened, OpenedMessage) and opened.max_context == CONTEXT


@pytest.mark.slow
def test_a_client_of_another_protocol_version_is_refused_naming_both(default_url, default_files) -> None:
    """An older client's `open`, byte for byte as it sends it, and a newer one's get a refusal naming both
    versions (an older client reads error frames as this one does); the connection stays usable."""
    layers = (FIRST, default_files.config.num_layers - LAST)
    older = wire.encode({"op": "open", "version": 3, "fingerprint": default_files.fingerprint, "layers": list(layers),
                         "dtype": "float32", "max_context": CONTEXT, "id": 1})
    newer = messages.encode(OpenMessage(default_files.fingerprint, layers, "float32", version=PROTOCOL_VERSION + 1))
    with RawClient(default_url) as raw:
        for message, theirs in ((older, 3), (newer, PROTOCOL_VERSION + 1)):
            refused = raw.send_raw(message)
            assert isinstance(refused, ErrorMessage) and refused.code == "version_mismatch"
            assert (
                f"server speaks protocol {PROTOCOL_VERSION} and the client speaks protocol {theirs}" in refused.message
            )
        assert isinstance(raw.send(OpenMessage(default_files.fingerprint, layers, "float32", CONTEXT)), OpenedMessage)


@pytest.mark.slow
def test_model_mismatch_names_the_servers_model_and_both_fingerprints(default_url, default_files) -> None:
    with RawClient(default_url) as raw:
        message = raw.request(_open_header(default_files, fingerprint="0" * 64)).message  # type: ignore[union-attr]
    assert default_files.path.name in message and default_files.fingerprint[:16] in message and "0" * 16 in message


@pytest.mark.slow
def test_split_mismatch_names_both_splits(default_url, default_files) -> None:
    with RawClient(default_url) as raw:
        message = raw.request(_open_header(default_files, layers=[4, 26])).message  # type: ignore[union-attr]
    assert "[2, 28) (a client with --first 2 --last 2)" in message and message.endswith("asked for [4, 26)")


# --- hostile frames between the steps of a real decode -------------------------------------------------


def _hostile(header: dict, hidden: torch.Tensor, other_session: str, max_position: int) -> list[tuple[str, bytes, str]]:
    """(what, message, expected error code): broken variations of one real step."""
    n, d = hidden.shape
    ok = wire.encode(header, hidden, "float32")
    nan, inf = hidden.clone(), hidden.clone()
    nan[0, 3], inf[-1, 0] = float("nan"), float("inf")
    no_vis = {k: v for k, v in header.items() if k not in ("parents", "bits")}
    no_session = {k: v for k, v in header.items() if k != "session"}

    def step(tensor: torch.Tensor = hidden, dtype: str = "float32", base: dict = header, **fields: object) -> bytes:
        return wire.encode({**base, **fields}, tensor, dtype)

    return [
        ("unknown op", wire.encode({**header, "op": "frobnicate"}), "unknown_op"),
        ("truncated payload", ok[:-7], "bad_shape"),
        ("truncated header", ok[:6], "bad_frame"),
        ("only the length", ok[:4], "bad_frame"),
        ("garbage", bytes(range(7, 250, 3)) * 5, "bad_frame"),
        ("empty", b"", "bad_frame"),
        ("no tensor", wire.encode(header), "bad_shape"),
        ("wrong hidden size", step(hidden[:, : d - 1]), "bad_shape"),
        ("other wire dtype", step(dtype="float16"), "bad_dtype"),
        ("unknown dtype", wire.encode({**header, "dtype": "int8", "shape": [n, d]}) + bytes(n * d), "bad_dtype"),
        ("negative position", step(positions=[-1] * n), "bad_request"),
        ("position past the model", step(positions=[max_position] * n), "bad_request"),
        ("position overflows", step(positions=[2**63] * n), "bad_request"),
        ("positions too few", step(positions=header["positions"][:-1]), "bad_positions"),
        ("float positions", step(positions=[0.5] * n), "bad_positions"),
        ("beyond max context", step(torch.zeros(CONTEXT + 1, d), base=no_vis, positions=list(range(CONTEXT + 1))),
         "bad_request"),
        ("parent of itself", step(base=no_vis, parents=list(range(n))), "bad_request"),
        ("parent out of range", step(base=no_vis, parents=[n] * n), "bad_request"),
        ("parents too many", step(base=no_vis, parents=[-1] * (n + 1)), "bad_request"),
        ("parents not a list", step(base=no_vis, parents=3), "bad_request"),
        ("bits too short", step(base=no_vis, bits=b""), "bad_request"),
        ("keep not a list", step(keep="all"), "bad_keep"),
        ("keep past pending", step(keep=[10**6]), "bad_request"),
        ("keep decreasing", step(keep=[1, 0]), "bad_request"),
        ("keep negative", step(keep=[-1]), "bad_request"),
        ("crop past the committed entries", step(keep=[], crop=10**6), "bad_request"),
        ("crop negative", step(keep=[], crop=-1), "bad_request"),
        ("crop and keep", step(keep=[0], crop=0), "bad_keep"),
        ("NaN hidden", step(nan), "bad_values"),
        ("Inf hidden", step(inf), "bad_values"),
        ("unknown session", step(session="no-such-session"), "unknown_session"),
        ("no session", step(base=no_session), "unknown_session"),
        ("another connection's session", step(session=other_session), "unknown_session"),
    ]


class _HostileMiddle:
    """A server session that receives, before each real step, every hostile variation of it."""

    overlaps = False
    row_invariant = True
    max_context = CONTEXT  # what its sessions ask for (`_open_header`)

    def __init__(self, raw: RawClient, session: str, other_session: str, max_position: int, hostile_steps: int) -> None:
        self.raw, self.session, self.other, self.max_position = raw, session, other_session, max_position
        self.hostile_steps = hostile_steps
        self.refused: list[str] = []
        self.ids = iter(range(100, 10**6))

    def step(
        # the decoder runs what this leaves
        self, step: Step, timing: StepTiming, while_waiting: Iterator[object] | None = None
    ) -> torch.Tensor:
        parents, bits = step.vis.to_wire()
        request = StepMessage(self.session, step.inputs, "float32", tuple(step.positions.tolist()), step.keep, parents,
                              bits)
        header = request.header()
        if self.hostile_steps > 0:
            self.hostile_steps -= 1
            for what, message, code in _hostile(header, step.inputs, self.other, self.max_position):
                message, rid = _with_id(message, next(self.ids))
                refused = self.raw.send_raw(message)
                assert isinstance(refused, ErrorMessage) and (refused.code, refused.id) == (code,
                                                                                            rid), f"{what}: {refused}"
                assert refused.message, what
                self.refused.append(what)
        reply = self.raw.send(replace(request, id=next(self.ids)))
        assert isinstance(reply, ResultMessage), reply
        return reply.hidden.float()


def _with_id(message: bytes, rid: int) -> tuple[bytes, int | None]:
    """The frame with an id in its header, and the id its error must echo (None: unparseable bytes)."""
    try:
        frame = wire.decode(message)
    except wire.ProtocolError:
        return message, None
    return wire.encode({**frame.header, "id": rid}) + frame.payload, rid


@pytest.mark.slow
def test_hostile_frames_leave_the_session_decoding_correctly(default_url, default_files, load_client_model,
                                                             split_greedy):
    client_model = load_client_model(None, FIRST, LAST)
    prompt = SplitClient(None, None, FIRST, LAST, precision=EXACT).encode_prompt(PROMPT)
    expected = split_greedy(client_model, default_url, prompt, 12)
    with RawClient(default_url) as raw, RawClient(default_url) as other:
        other_session = other.request(_open_header(default_files)).session  # type: ignore[union-attr]
        session = raw.request(_open_header(default_files)).session  # type: ignore[union-attr]
        middle = _HostileMiddle(raw, session, other_session, default_files.config.max_position, hostile_steps=3)
        pipeline = SplitPipeline(client_model, middle, CONTEXT)
        got = [t for out in decode_sequential(pipeline, prompt, 12, frozenset()) for t in out.tokens]
        assert len(middle.refused) == 3 * len(set(middle.refused)) >= 3 * 25
        # the other connection's session was never touched either
        assert isinstance(other.step(other_session, torch.zeros(1, HIDDEN), [0], []), ResultMessage)
    assert got == expected


@pytest.mark.slow
def test_error_frames_echo_the_request_id(default_url, default_files) -> None:
    with RawClient(default_url) as raw:
        session = raw.request(_open_header(default_files)).session  # type: ignore[union-attr]
        step = {"op": "step", "session": session, "positions": [0], "keep": []}
        reply = raw.request({**step, "id": "abc"}, torch.zeros(1, 5))
        assert reply == ErrorMessage("bad_shape", reply.message, id="abc")  # type: ignore[union-attr]
        assert raw.request({"op": "close", "id": 4, "session": session}) == ClosedMessage(4)
        gone = raw.request({**step, "id": 5}, torch.zeros(1, HIDDEN))
        assert isinstance(gone, ErrorMessage) and (gone.code, gone.id) == ("unknown_session", 5)
        again = raw.request({"op": "close", "id": 6, "session": session})
        assert isinstance(again, ErrorMessage) and again.code == "unknown_session"


@pytest.mark.slow
def test_a_session_dies_with_its_connection_only(default_url, default_files) -> None:
    with RawClient(default_url) as keeper:
        kept = keeper.request(_open_header(default_files)).session  # type: ignore[union-attr]
        with RawClient(default_url) as leaver:
            leaver.request(_open_header(default_files))
        with RawClient(default_url) as thief:
            stolen = thief.step(kept, torch.zeros(1, HIDDEN), [0], [])
            assert isinstance(stolen, ErrorMessage) and stolen.code == "unknown_session"
        assert isinstance(keeper.step(kept, torch.zeros(1, HIDDEN), [0], []), ResultMessage)


@pytest.mark.slow
def test_a_text_frame_closes_that_connection_with_a_reason(default_url, default_files) -> None:
    from websockets.exceptions import ConnectionClosed

    with RawClient(default_url) as keeper:
        kept = keeper.request(_open_header(default_files)).session  # type: ignore[union-attr]
        with RawClient(default_url) as texter:
            texter.ws.send("not a frame")
            with pytest.raises(ConnectionClosed) as closed:
                texter.ws.recv(timeout=30)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1003
        assert isinstance(keeper.step(kept, torch.zeros(1, HIDDEN), [0], []), ResultMessage)


def test_server_settings_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        ServerSettings(2, 2)  # type: ignore[misc]


# --- concurrency ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_concurrent_sessions_do_not_interfere(default_url) -> None:
    client = SplitClient(None, default_url, FIRST, LAST, wire_dtype="float32", max_context=256, precision=EXACT)
    # The server batches concurrent steps, which rounds differently from solo steps (~1e-4); these
    # prompts' greedy top-2 logit gaps stay above 0.07 over the 20 tokens, so rounding cannot flip a token.
    texts = [
        "What is the capital of France?",
        "Name the planets of the solar system.",
        "Explain what a hash table is.",
        "What is the boiling point of water?",
    ]
    prompts = [client.encode_prompt(t) for t in texts]  # token ids: the threads share no tokenizer state
    solo = [client.generate(p, 20, "sequential").ids for p in prompts]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        try:
            barrier.wait()
            results[i] = client.generate(prompts[i], 20, "sequential").ids
        except BaseException as exc:  # surfaced below: a thread's failure must fail the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert [results[i] for i in range(len(prompts))] == solo


def test_the_server_loads_and_steps_on_one_compute_thread(tiny_models, load_client_model, split_greedy,
                                                          stage_threads) -> None:
    """PyTorch keeps a thread pool per thread that starts parallel work; a server that loaded on one
    thread and stepped on another ran its steps at half speed (threads.ComputeThread)."""
    model = tiny_models["qwen2"]
    client_model = load_client_model(model, 1, 1)
    with ServerThread(MiddleServer(str(model), ServerSettings(first=1, last=1))) as server:
        split_greedy(client_model, server.url, [5, 9, 2, 7], 4)
    middle = [(what, name) for what, start, name in stage_threads if start == 1]
    assert {what for what, _ in middle} == {"load", "forward"}
    assert {name for _, name in middle} == {server.server.compute.run(lambda: threading.current_thread().name)}
