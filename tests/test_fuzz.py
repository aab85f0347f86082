"""Hostile frames against a live server (hypothesis), interleaved with real decoding.

Every example sends a few generated frames (random bytes, lying length prefixes, random msgpack
headers, poisoned copies of the next real step: wrong shapes, dtypes, NaN/Inf, huge declared
sizes, invalid trees and keeps, truncations; replayed and foreign session ids; text and oversized
frames on throwaway connections) and then the real step they were mixed into. Meanwhile a
well-behaved client decodes on its own connection. The decode under attack and the bystander must
both produce exactly their solo tokens; every binary frame gets a well-formed reply, never an
internal error; the server stays up.

CI runs a few hundred frames. SPLITLLM_FUZZ_FRAMES=10000 runs more, and SPLITLLM_FUZZ_REPORT=PATH
writes the run's figures as JSON.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
import torch
from conftest import TINY_SPLIT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from protocol_client import RawClient, greedy, seeded_greedy
from websockets.exceptions import ConnectionClosed

from splitllm.protocol import messages, wire
from splitllm.protocol.messages import ClosedMessage, ErrorMessage, OpenedMessage, ResultMessage, StepMessage
from splitllm.client.pipeline import SplitPipeline
from splitllm.client.remote import RemoteMiddle
from splitllm.decoding.sequential import decode_sequential
from splitllm.weights.sources import ModelFiles
from splitllm.stats import StepTiming
from splitllm.model.stage import Step

FIRST, LAST = TINY_SPLIT
NEW = 24
FRAMES = int(os.environ.get("SPLITLLM_FUZZ_FRAMES", "400"))
LIMITS = {"max_nodes_per_step": 16, "max_frame_bytes": 1 << 18}
POISONS = (
    "nan", "inf", "width", "dtype", "positions_len", "positions_type", "position_range", "keep_range",
    "keep_order", "keep_type", "parents", "bits", "too_many", "declared_shape", "truncated", "no_tensor",
)
ROLES = ("scratch", "foreign", "replayed", "random", "missing")
_STEP_KEYS = {"op", "session", "positions", "keep", "parents", "bits", "dtype", "shape"}  # extras leave these be

# --- what a frame is made of ------------------------------------------------------------------------------

_ints = st.integers(-(2**63), 2**64 - 1)
_scalars = st.one_of(st.none(), st.booleans(), _ints, st.floats(), st.text(max_size=12), st.binary(max_size=24))
_values = st.recursive(
    _scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=8,
)
_keys = st.sampled_from(["op", "id", "session", "positions", "keep", "parents", "bits", "dtype", "shape",
                         "version", "fingerprint", "layers", "max_context"]) | st.text(max_size=6)
_ops = st.sampled_from(["open", "step", "close", "result", "error", "opened", ""]) | st.text(max_size=6)


@dataclass
class Spec:
    """One hostile frame, resolved against the live state (session ids, the real step) when sent."""

    kind: str
    header: dict[str, Any] = field(default_factory=dict)
    payload: bytes = b""
    role: str = "random"
    poison: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    size: int = 0


@st.composite
def _random_header(draw: st.DrawFn) -> Spec:
    header = draw(st.dictionaries(_keys, _values, max_size=7))
    header["op"] = draw(_ops)
    if draw(st.booleans()):
        header["dtype"] = draw(st.sampled_from(list(wire.WIRE_DTYPES)) | st.text(max_size=8))
        header["shape"] = draw(st.lists(st.integers(-2, 2**64 - 1) | st.integers(0, 80), max_size=3))
    return Spec("header", header, draw(st.binary(max_size=400)), draw(st.sampled_from(ROLES)))


@st.composite
def _open(draw: st.DrawFn) -> Spec:
    """A real open header with some fields replaced by anything."""
    fields = draw(st.dictionaries(st.sampled_from(["version", "fingerprint", "layers", "dtype", "max_context", "id"]),
                                  _values, min_size=1, max_size=3))
    return Spec("open", fields)


_frames = st.one_of(
    _open(),
    st.builds(lambda b: Spec("bytes", payload=b), st.binary(max_size=300)),
    st.builds(lambda n, b: Spec("length", payload=struct.pack(">I", n) + b), st.integers(0, 2**32 - 1),
              st.binary(max_size=64)),
    _random_header(),
    st.builds(
        lambda p, extra, role: Spec("poison", poison=p, extra=extra, role=role),
        st.sampled_from(POISONS),
        st.dictionaries(st.text(min_size=1, max_size=6).filter(lambda k: k not in _STEP_KEYS), _scalars, max_size=2),
        st.sampled_from(("live", "live", "live", "foreign", "replayed")),
    ),
    st.builds(lambda s: Spec("text", payload=s.encode()), st.text(max_size=40)),
    st.builds(lambda extra: Spec("oversized", size=LIMITS["max_frame_bytes"] + 1 + extra), st.integers(0, 4096)),
)


# --- the frames, made concrete ----------------------------------------------------------------------------


def _poisoned(spec: Spec, header: dict[str, Any], hidden: torch.Tensor, pending: int) -> bytes:
    """The real step with one flaw the server must refuse without touching the session."""
    n, d = hidden.shape
    h, x, dtype = {**header, **spec.extra}, hidden.clone(), "float32"
    p = spec.poison
    if p == "nan":
        x[n // 2, d // 3] = float("nan")
    elif p == "inf":
        x[-1, 0] = float("-inf")
    elif p == "width":
        x = torch.randn(n, d + 1)
    elif p == "dtype":
        dtype = "float16"
    elif p == "positions_len":
        h["positions"] = h["positions"] + [h["positions"][-1] + 1]
    elif p == "positions_type":
        h["positions"] = [float(i) + 0.5 for i in h["positions"]]
    elif p == "position_range":
        h["positions"] = [-1] * n
    elif p == "keep_range":
        h["keep"] = [pending]
    elif p == "keep_order":
        h["keep"] = [1, 0]
    elif p == "keep_type":
        h["keep"] = {"all": True}
    elif p == "parents":
        h["parents"] = list(range(n))  # every node its own parent
    elif p == "bits":
        h.pop("parents", None)
        h["bits"] = b"\xff" * ((n * n + 7) // 8 + 1)
    elif p == "too_many":
        m = LIMITS["max_nodes_per_step"] + 1
        x, h["positions"], h["parents"] = torch.randn(m, d), list(range(m)), list(range(-1, m - 1))
    elif p == "declared_shape":
        return wire.encode({**h, "dtype": "float32", "shape": [2**40, d]}) + x.numpy().tobytes()
    elif p == "truncated":
        return wire.encode(h, x, dtype)[:-3]
    elif p == "no_tensor":
        return wire.encode(h)
    return wire.encode(h, x, dtype)


def _pack(header: dict[str, Any]) -> bytes:
    head = msgpack.packb(header, use_bin_type=True)
    return struct.pack(">I", len(head)) + head


class Target:
    """The decode under attack: one connection, a live session fed real steps, a scratch session; to the
    decoder, the middle its steps go through."""

    max_context = 64  # what its sessions ask for
    overlaps = False
    row_invariant = True

    def __init__(  # type: ignore[no-untyped-def]
        self, url: str, files: ModelFiles, client_model, prompt: list[int], expected: list[int], bystander
    ) -> None:
        self.url, self.files, self.client_model = url, files, client_model
        self.layers = (FIRST, files.config.num_layers - LAST)
        self.prompt, self.expected, self.bystander = prompt, expected, bystander
        self.raw = RawClient(url)
        self._open_header = {"op": "open", "version": messages.PROTOCOL_VERSION, "fingerprint": files.fingerprint,
                             "layers": list(self.layers), "dtype": "float32", "max_context": 64}
        self.replayed: list[str] = []
        self.scratch = self._open()
        self.counts: Counter[str] = Counter()
        self.codes: Counter[str] = Counter()
        self.specs: Sequence[Spec] = ()
        self.steps = self.decodes = 0
        self._restart()

    def _open(self) -> str:
        opened = self.raw.open(self.files, self.layers, 64)
        assert isinstance(opened, OpenedMessage), opened
        return opened.session

    def _restart(self) -> None:
        self.live = self._open()
        self.got: list[int] = []
        pipeline = SplitPipeline(self.client_model, self, 64)
        self.decoder = decode_sequential(pipeline, self.prompt, NEW, frozenset(), seeded_greedy())

    def session_for(self, role: str) -> Any:
        return {
            "live": self.live,
            "scratch": self.scratch,
            "foreign": self.bystander.session,
            "replayed": self.replayed[-1] if self.replayed else "x" * 24,
            "random": "y" * 24,
        }.get(role)

    def advance(self, specs: Sequence[Spec]) -> None:
        """Send the specs mixed into the next real step, then check that step's token."""
        self.specs = specs
        try:
            out = next(self.decoder)
        except StopIteration:
            assert self.got == self.expected, "the decode under attack diverged"
            self.decodes += 1
            assert isinstance(self.raw.close_session(self.live), ClosedMessage)
            self.replayed.append(self.live)
            self._restart()
            out = next(self.decoder)
        self.got.extend(out.tokens)
        assert self.got == self.expected[: len(self.got)], "the decode under attack diverged"

    # Middle protocol: called by the decoder for each real step.
    def step(
        # the decoder runs what this leaves
        self, step: Step, timing: StepTiming, while_waiting: Iterator[object] | None = None
    ) -> torch.Tensor:
        parents, bits = step.vis.to_wire()
        request = StepMessage(self.live, step.inputs, "float32", tuple(step.positions.tolist()), step.keep, parents,
                              bits, 1)
        pending = step.keep[-1] + 1 if step.keep else 0
        for spec in self.specs:
            self._send(spec, request.header(), step.inputs, pending)
        reply = self.raw.send(request)
        assert isinstance(reply, ResultMessage), reply
        self.steps += 1
        return reply.hidden.float()

    def _send(self, spec: Spec, header: dict[str, Any], hidden: torch.Tensor, pending: int) -> None:
        self.counts[spec.kind] += 1
        if spec.kind in ("text", "oversized"):
            return self._connection_breaker(spec)
        if spec.kind == "poison":
            message = _poisoned(spec, {**header, "session": self.session_for(spec.role)}, hidden, pending)
        elif spec.kind == "open":
            message = _pack({**self._open_header, **spec.header})
        elif spec.kind == "header":
            h = dict(spec.header)
            if spec.role != "missing":
                h["session"] = self.session_for(spec.role)
            message = _pack(h) + spec.payload
        else:
            message = spec.payload
        reply = self.raw.send_raw(message)  # a well-formed reply of a known kind, or this raises
        self.codes[reply.code if isinstance(reply, ErrorMessage) else reply.OP] += 1
        if isinstance(reply, ErrorMessage):
            assert reply.code != "internal", (spec, reply)
        if spec.kind == "poison" or spec.role in ("foreign", "replayed"):
            assert isinstance(reply, ErrorMessage), (spec, reply)  # refused, whatever else the frame says
        if isinstance(reply, ClosedMessage):  # only the scratch session can be closed by these frames
            self.replayed.append(self.scratch)
            self.scratch = self._open()
        if isinstance(reply, OpenedMessage):  # a mutation that is still a valid open: let it go again
            assert isinstance(self.raw.close_session(reply.session), ClosedMessage)

    def _connection_breaker(self, spec: Spec) -> None:
        """Frames the WebSocket layer refuses by closing the connection: sent on a throwaway one."""
        with RawClient(self.url) as throwaway, pytest.raises(ConnectionClosed):
            throwaway.ws.send(spec.payload.decode() if spec.kind == "text" else b"\0" * spec.size)
            throwaway.ws.recv(timeout=30)
        self.codes["closed:" + spec.kind] += 1


class Bystander:
    """A well-behaved client decoding on its own connection until told to stop."""

    def __init__(self, url: str, files: ModelFiles, client_model, prompt: list[int],  # type: ignore[no-untyped-def]
                 expected: list[int]) -> None:
        self.url, self.files, self.client_model, self.prompt, self.expected = url, files, client_model, prompt, expected
        self.session = ""
        self.runs, self.mismatches, self.errors = 0, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        layers = (FIRST, self.files.config.num_layers - LAST)
        while not self._stop.is_set():
            try:
                middle = RemoteMiddle(self.url, self.files.fingerprint, layers, "float16", 64)
                self.session = middle.session
                got = greedy(self.client_model, middle, self.prompt, NEW)
            except Exception as exc:  # recorded and asserted on by the test
                self.errors.append(repr(exc))
                return
            self.runs += 1
            self.mismatches += got != self.expected

    def __enter__(self) -> Bystander:
        self._thread.start()
        while not self.session and not self.errors:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)


@pytest.fixture(scope="module")
def arena(tiny, server, load_client_model, random_ids):  # type: ignore[no-untyped-def]
    thread = server(tiny, FIRST, LAST, **LIMITS)
    files, client_model = ModelFiles(tiny), load_client_model(tiny, FIRST, LAST)
    layers = (FIRST, files.config.num_layers - LAST)
    prompts = random_ids(10, 21), random_ids(7, 22)
    solo = [
        greedy(client_model, RemoteMiddle(thread.url, files.fingerprint, layers, dtype, 64), p, NEW)
        for p, dtype in zip(prompts, ("float32", "float16"))
    ]
    with Bystander(thread.url, files, client_model, prompts[1], solo[1]) as bystander:
        target = Target(thread.url, files, client_model, prompts[0], solo[0], bystander)
        t0 = time.monotonic()
        yield thread, target, bystander
        elapsed = time.monotonic() - t0
    assert not bystander.errors and bystander.mismatches == 0 and bystander.runs >= 1
    health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{thread.port}/health", timeout=10).read())
    alive = health["status"] == "ok" and thread._thread.is_alive()
    assert alive
    report = {  # a diverging decode or an internal error fails the example that saw it
        "hostile_frames": sum(target.counts.values()),
        "real_steps": target.steps,
        "decodes_under_attack_completed": target.decodes,
        "bystander_runs": bystander.runs,
        "bystander_mismatches": bystander.mismatches,
        "server_alive_after": alive,
        "internal_errors": target.codes["internal"],
        "frames_by_kind": dict(target.counts),
        "replies_by_code": dict(target.codes),
        "seconds": round(elapsed, 1),
    }
    print("\nfuzz:", json.dumps(report))
    if os.environ.get("SPLITLLM_FUZZ_REPORT"):
        with open(os.environ["SPLITLLM_FUZZ_REPORT"], "w") as f:
            json.dump(report, f, indent=2)


@settings(
    max_examples=math.ceil(FRAMES / 3),  # 1-6 hostile frames an example
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(specs=st.lists(_frames, min_size=1, max_size=6))
def test_hostile_frames_never_crash_or_corrupt(arena, specs: list[Spec]) -> None:  # type: ignore[no-untyped-def]
    _, target, bystander = arena
    target.advance(specs)
    assert not bystander.errors and bystander.mismatches == 0


@pytest.mark.parametrize(
    "header",
    [
        {"op": "step", "dtype": ["float32"], "shape": [1, 1]},  # an unhashable dtype
        {"op": "open", "dtype": {"x": 1}, "shape": [0, 0]},
        {"op": "step", "dtype": "float32", "shape": [2**64 - 1, 0]},  # no bytes, but too big for torch
        {"op": "step", "dtype": "float32", "shape": [0, 2**62]},
    ],
)
def test_frames_the_fuzzer_once_found(arena, header: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    thread = arena[0]
    with RawClient(thread.url) as raw:
        reply = raw.send_raw(_pack(header))
    assert isinstance(reply, ErrorMessage) and reply.code in ("bad_dtype", "bad_shape"), reply
