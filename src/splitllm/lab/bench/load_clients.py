"""The clients of `splitllm bench load`: real ones computing here, and replays of their solo runs.

A real client runs its first and last stages and LM head on this machine; a replayed one stands
for a client on its own device, sending the steps its prompt's solo run recorded and pausing for the client compute
that run measured.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from splitllm.client.pipeline import SplitPipeline
from splitllm.client.remote import RemoteMiddle
from splitllm.client.client import SplitClient
from splitllm.decoding.sequential import decode_sequential
from splitllm.stats import StepTiming
from splitllm.model.stage import Step


@dataclass
class ClientRun:
    """What one client saw: its tokens, each step's latency and the server's compute in it, its failures."""

    prompt: int
    ids: list[int] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)  # wall time of each step as the client saw it
    server_ms: list[float] = field(default_factory=list)  # the server's compute inside it
    reconnects: int = 0
    error: str | None = None
    matches_solo: bool = True  # replayed steps: every reply within wire rounding of the solo run's


@dataclass(frozen=True)
class Call:
    """One middle step of a solo run: what went out, what came back, and the client's compute before it."""

    client_ms: float
    step: Step
    reply: torch.Tensor


class _Recorder:
    """A Middle that forwards steps to a real one and records them, for clients replayed on emulated devices."""

    def __init__(self, inner: RemoteMiddle) -> None:
        self.inner = inner
        self.calls: list[Call] = []
        self._last = time.perf_counter()
        self.max_context, self.max_nodes, self.overlaps = inner.max_context, inner.max_nodes, inner.overlaps
        self.row_invariant = inner.row_invariant

    def step(self, step: Step, timing: StepTiming, while_waiting: Iterator[object] | None = None) -> torch.Tensor:
        client_ms = (time.perf_counter() - self._last) * 1000
        out = self.inner.step(step, timing, while_waiting)
        sent = Step(step.inputs.clone(), step.positions.clone(), step.vis, step.keep)
        self.calls.append(Call(client_ms, sent, out.clone()))
        self._last = time.perf_counter()
        return out


def _middle(client: SplitClient, url: str, context: int) -> RemoteMiddle:
    files = client.files
    return RemoteMiddle(url, files.fingerprint, client.client_model.middle_range, client.wire_dtype, context,
                        client.connection)


def decode(
    client: SplitClient, url: str, prompt: list[int], n: int, context: int, run: ClientRun, record: bool = False
) -> tuple[ClientRun, list[Call]]:
    """A real client: first and last stages and LM head computed here. `record` keeps its steps for replays."""
    middle = _middle(client, url, context)
    recorder = _Recorder(middle) if record else None
    try:
        pipeline = SplitPipeline(client.client_model, recorder or middle, context)
        last = time.perf_counter()
        for out in decode_sequential(pipeline, prompt, n, frozenset()):
            now = time.perf_counter()
            run.ids.extend(out.tokens)
            run.step_ms.append((now - last) * 1000)
            run.server_ms.append(out.stats.timing.server_ms)
            last = now
        run.reconnects = middle.reconnects
    finally:
        middle.close()
    return run, recorder.calls if recorder else []


def replay(client: SplitClient, url: str, calls: list[Call], context: int, run: ClientRun) -> ClientRun:
    """A client on its own device: its compute is a pause as long as the solo run's, its steps the same.

    Replies are checked against the solo run's within float16 wire rounding (a batched forward may
    round differently in float32 before the wire rounds again).
    """
    middle = _middle(client, url, context)
    try:
        last = time.perf_counter()
        for call in calls:
            time.sleep(call.client_ms / 1000)
            timing = StepTiming()
            out = middle.step(call.step, timing)
            now = time.perf_counter()
            run.step_ms.append((now - last) * 1000)
            run.server_ms.append(timing.server_ms)
            run.matches_solo &= torch.allclose(out, call.reply, rtol=2e-3, atol=1e-3)
            last = now
        run.reconnects = middle.reconnects
    finally:
        middle.close()
    return run


@dataclass(frozen=True)
class Solo:
    """A prompt's run with nobody else connected: its tokens and its recorded steps."""

    ids: list[int]
    calls: list[Call]


def solo_runs(client: SplitClient, url: str, prompt_ids: list[list[int]], new_tokens: int, context: int) -> list[Solo]:
    """Each prompt decoded with nobody else connected, its steps recorded for replays."""
    runs = (decode(client, url, p, new_tokens, context, ClientRun(i), record=True) for i, p in enumerate(prompt_ids))
    return [Solo(run.ids, calls) for run, calls in runs]
