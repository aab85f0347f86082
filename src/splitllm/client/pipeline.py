"""Score a step's nodes through the whole split model: first stage -> middle (wire) -> last stage -> LM head.

Decoders see only `SplitPipeline.score`, so the same proposers and verifier run over the network
(RemoteMiddle) or in-process (InProcessMiddle, for tests and offline benchmarks).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from splitllm.client.client_model import ClientModel
from splitllm.model.kv import KVCache
from splitllm.model.stage import Stage, Step
from splitllm.model.visibility import Visibility
from splitllm.stats import StepTiming


class Middle(Protocol):
    max_context: int  # positions its cache holds (a server may grant fewer than asked)
    max_nodes: int  # positions one step may send
    overlaps: bool  # whether the client's core is free while a step is in flight (the middle computes elsewhere)
    row_invariant: bool  # whether a row's outputs are the same bits in any step (Stage.row_invariant)

    def step(self, step: Step, timing: StepTiming, while_waiting: Iterator[object] | None = None) -> torch.Tensor:
        """The middle's outputs for the step's hidden states, its times added to `timing`. `while_waiting` is
        client work in pieces: one piece (`next`) runs while each request of the step is in flight; the
        caller runs what remains."""
        ...

    @property
    def ahead_ready(self) -> bool:
        """Whether a step may be sent ahead now (from a piece of `while_waiting`)."""
        ...

    def send_ahead(self, step: Step, timing: StepTiming) -> None:
        """Send a step whose keep refers to the step in flight, to run right after it."""
        ...

    def receive_ahead(self, timing: StepTiming, while_waiting: Iterator[object] | None = None) -> torch.Tensor:
        """The outputs of the step sent ahead, `while_waiting` as in `step`."""
        ...

    def drop_ahead(self) -> None:
        """Give up the step sent ahead: its keep stays applied, what it added is for the next step to crop."""
        ...


class InProcessMiddle:
    """The middle stage run in this process, with the same contract as a server session."""

    overlaps = False  # it computes on the client's own cores

    def __init__(self, stage: Stage, max_context: int) -> None:
        self.stage = stage
        self.max_context = self.max_nodes = max_context
        self.row_invariant = stage.row_invariant
        self.cache: KVCache = stage.new_cache(max_context)
        self._ahead: torch.Tensor | None = None  # the output of the step sent ahead, computed when sent
        self._in_step = False

    def step(self, step: Step, timing: StepTiming, while_waiting: Iterator[object] | None = None) -> torch.Tensor:
        return self._run(lambda: self.stage(self.cache, step), timing, while_waiting)

    def _run(
        self, compute: Callable[[], torch.Tensor], timing: StepTiming, while_waiting: Iterator[object] | None
    ) -> torch.Tensor:
        t0 = time.perf_counter()
        out = compute()
        if while_waiting is not None:  # nothing is in flight here: one piece runs, inside the step's time
            self._in_step = True
            try:
                next(while_waiting, None)
            finally:
                self._in_step = False
        ms = (time.perf_counter() - t0) * 1000
        timing.server_ms += ms
        timing.round_trip_ms += ms  # no network in-process: the round trip is the compute
        return out

    @property
    def ahead_ready(self) -> bool:
        return self._in_step and self._ahead is None

    def send_ahead(self, step: Step, timing: StepTiming) -> None:
        self._ahead = self.stage(self.cache, step)

    def receive_ahead(self, timing: StepTiming, while_waiting: Iterator[object] | None = None) -> torch.Tensor:
        out, self._ahead = self._ahead, None
        assert out is not None
        return self._run(lambda: out, timing, while_waiting)

    def drop_ahead(self) -> None:
        self._ahead = None


@dataclass(frozen=True)
class _Ahead:
    """A step sent ahead (token ids, keep over the caches' entries), its first-stage outputs, and the
    first stage's committed length before it."""

    step: Step
    low: torch.Tensor
    base: int


class SplitPipeline:
    """One generation's state on the client: its own caches and its middle session."""

    def __init__(self, client_model: ClientModel, middle: Middle, max_context: int) -> None:
        self.client_model = client_model
        self.middle = middle
        self.caches = client_model.new_caches(min(max_context, middle.max_context))  # what the middle granted
        self.score_ms = 0.0  # wall time spent in score() since the last take_score_ms()
        self._outputs: dict[int, torch.Tensor] = {}  # the last step's first-stage and middle outputs, by layer count
        # The last step as the caches took it (token ids), whose entries the next step's keep picks from,
        # with the `_shift` entries put before the decoder's own when it was rebased (see `_rebase`).
        self._last: Step | None = None
        self._shift = 0
        self._ahead: _Ahead | None = None
        self._dropped: _Ahead | None = None  # a step sent ahead and given up: the next step undoes it

    @property
    def committed(self) -> int:
        """Positions committed in the caches (the previous step's kept entries count once kept), as the
        decoder counts them: a step sent ahead and dropped is not."""
        base = self._dropped.base if self._dropped is not None else self.caches.first.length
        return base + self._shift

    @property
    def max_context(self) -> int:
        """Positions every cache holds, within the model's maximum position."""
        return min(self.caches.first.max_context, self.middle.max_context, self.client_model.cfg.max_position)

    @property
    def overlaps(self) -> bool:
        """Whether the client's core is free while a step is in flight, for work that can go there."""
        return self.middle.overlaps

    @property
    def row_invariant(self) -> bool:
        """Whether every part of the split gives a row the same bits in any step: speculation reproduces
        sequential decoding only then."""
        return self.client_model.row_invariant and self.middle.row_invariant

    def room(self, start: int) -> int:
        """How many positions a step starting at absolute position `start` may send: what the caches
        have left (and the model's last position) and the middle's per-step cap both bound it."""
        return max(min(self.max_context - start, self.middle.max_nodes), 0)

    def score(
        self, step: Step, rows: torch.Tensor | None = None, timing: StepTiming | None = None
    ) -> tuple[torch.Tensor, StepTiming]:
        """Logits for the chosen rows (all by default) of a step of token ids, after one round trip."""
        hidden, timing = self.forward(step, timing)
        return self.logits(hidden if rows is None else hidden[rows], timing), timing

    def forward(
        self, step: Step, timing: StepTiming | None = None, while_waiting: Iterator[object] | None = None
    ) -> tuple[torch.Tensor, StepTiming]:
        """Hidden states leaving the last stage for every node of a step of token ids, after one round
        trip; no LM head yet. Each stage and the middle take the same step, carrying what the one
        before made of its inputs.

        Decoders that need logits for only some nodes, decided as they go, call `logits` row by row.
        `while_waiting` is client work that needs nothing from this step (a draft model reading the
        prompt), in pieces: the middle runs one while each of its requests is in flight, where the
        client would otherwise wait; the caller runs what remains.
        """
        t0 = time.perf_counter()
        timing = timing or StepTiming()
        step, shift = self._rebase(self._translated(step))
        timing.nodes = step.inputs.numel()
        low = self.client_model.run_first(self.caches, step)
        self._last, self._shift = step, shift
        t1 = time.perf_counter()
        mid = self.middle.step(step.with_inputs(low), timing, while_waiting)
        t2 = time.perf_counter()
        hidden = self.client_model.run_last(self.caches, step.with_inputs(mid))
        self._outputs = dict(zip(self.client_model.tap_layers, (low[shift:], mid[shift:])))
        t3 = time.perf_counter()
        timing.first_ms = (t1 - t0) * 1000
        timing.last_ms = (t3 - t2) * 1000
        timing.context = self.committed
        self.score_ms += (time.perf_counter() - t0) * 1000
        return hidden[shift:], timing

    def _translated(self, step: Step) -> Step:
        """`step` with its keep over the last step's entries as the caches hold them (after `_shift` more)."""
        if not self._shift:
            return step
        return replace(step, keep=(*range(self._shift), *(k + self._shift for k in step.keep)))

    def _rebase(self, step: Step) -> tuple[Step, int]:
        """Undo a dropped step sent ahead: crop every cache back to where its keep and `step`'s part, and
        feed again, as a chain before `step`'s own entries, the last step's entries `step` keeps past
        there. Returns the step as the caches take it and how many entries it puts first."""
        dropped, self._dropped = self._dropped, None
        if dropped is None:
            return step, 0
        assert self._last is not None
        same = next((i for i, (a, b) in enumerate(zip(step.keep, dropped.step.keep)) if a != b),
                    min(len(step.keep), len(dropped.step.keep)))
        again = list(step.keep[same:])
        n = len(again)
        parents = [*range(-1, n - 1),
                   *(n - 1 if p < 0 else n + p for p in step.vis.parents)] if step.vis.parents else None
        if parents is not None:
            vis = Visibility.from_parents(parents)
        else:
            matrix = torch.zeros(n + step.n, n + step.n, dtype=torch.bool)
            matrix[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
            matrix[n:, :n] = True
            matrix[n:, n:] = step.vis.matrix
            vis = Visibility.from_matrix(matrix)
        index = torch.tensor(again, dtype=torch.long)
        inputs = torch.cat([self._last.inputs.index_select(0, index), step.inputs])
        positions = torch.cat([self._last.positions.index_select(0, index), step.positions])
        return Step(inputs, positions, vis, (), dropped.base + same), n

    @property
    def ahead_ready(self) -> bool:
        """Whether a step may go ahead of the one in flight now (called from its `while_waiting`)."""
        return self._ahead is None and self.middle.ahead_ready

    def send_ahead(self, step: Step, timing: StepTiming) -> None:
        """Send a step built on the likely outcome of the step in flight (its keep picks from that step's
        entries) before that step's reply comes back, so the middle runs it meanwhile. The next call
        after the step in flight returns is `receive_ahead` (the outcome came true) or `drop_ahead`."""
        t0 = time.perf_counter()
        step = self._translated(step)
        base = self.caches.first.length
        low = self.client_model.run_first(self.caches, step)
        t1 = time.perf_counter()
        self.middle.send_ahead(step.with_inputs(low), timing)
        self._ahead = _Ahead(step, low, base)
        timing.first_ms += (t1 - t0) * 1000
        timing.nodes = step.n

    def receive_ahead(
        self, timing: StepTiming, while_waiting: Iterator[object] | None = None
    ) -> torch.Tensor:
        """Hidden states leaving the last stage for the step sent ahead, which becomes the last step."""
        assert self._ahead is not None
        ahead, self._ahead = self._ahead, None
        self._last, self._shift = ahead.step, 0  # the step in flight, which a step sent meanwhile keeps from
        t0 = time.perf_counter()
        mid = self.middle.receive_ahead(timing, while_waiting)
        t1 = time.perf_counter()
        hidden = self.client_model.run_last(self.caches, ahead.step.with_inputs(mid))
        self._outputs = dict(zip(self.client_model.tap_layers, (ahead.low, mid)))
        timing.last_ms += (time.perf_counter() - t1) * 1000
        timing.context = self.committed
        self.score_ms += (time.perf_counter() - t0) * 1000
        return hidden

    def drop_ahead(self) -> None:
        """Give up the step sent ahead: the first stage and the middle ran it, so the last stage applies
        its keep too, and the next step crops what it added (`_rebase`)."""
        assert self._ahead is not None
        ahead, self._ahead = self._ahead, None
        self.middle.drop_ahead()
        if self.caches.last is not None:
            self.caches.last.keep(ahead.step.keep)
        self._dropped = ahead

    def tapped(self, layers: Sequence[int]) -> torch.Tensor:
        """The last step's outputs of `layers` (among `client_model.tap_layers`) side by side: (n, len(layers) d)."""
        missing = [t for t in layers if t not in self._outputs]
        if missing:
            raise ValueError(
                f"this client holds the outputs of layers {list(self.client_model.tap_layers)}, not {missing}"
            )
        return torch.cat([self._outputs[t].to(self.client_model.dtype) for t in layers], dim=-1)

    @property
    def shared_logit_rows(self) -> int:
        return self.client_model.shared_logit_rows

    def logits(self, hidden: torch.Tensor, timing: StepTiming) -> torch.Tensor:
        """LM head over `hidden`'s rows, timed as part of the step's last stage."""
        return self._timed(self.client_model.logits, hidden, timing)

    def approx_logits(self, hidden: torch.Tensor, timing: StepTiming) -> torch.Tensor:
        """The approximate LM head (`ModelEnds.approx_logits`) over `hidden`'s rows, timed the same way."""
        return self._timed(self.client_model.approx_logits, hidden, timing)

    def _timed(
        self, lm_head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, timing: StepTiming
    ) -> torch.Tensor:
        t0 = time.perf_counter()
        out = lm_head(hidden)
        ms = (time.perf_counter() - t0) * 1000
        timing.last_ms += ms
        self.score_ms += ms
        return out

    def take_score_ms(self) -> float:
        """Time spent scoring since the last call: what a step's wall time minus it leaves is the decoder's."""
        ms, self.score_ms = self.score_ms, 0.0
        return ms
