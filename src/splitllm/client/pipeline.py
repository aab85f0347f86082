"""Score a step's nodes through the whole split model: first stage -> middle (wire) -> last stage -> LM head.

Decoders see only `SplitPipeline.score`, so the same proposers and verifier run over the network
(RemoteMiddle) or in-process (InProcessMiddle, for tests and offline benchmarks).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch

from splitllm.client.client_model import ClientModel
from splitllm.model.kv import KVCache
from splitllm.model.stage import Stage, Step
from splitllm.stats import StepTiming


class Middle(Protocol):
    max_context: int  # positions its cache holds (a server may grant fewer than asked)
    max_nodes: int  # positions one step may send
    overlaps: bool  # whether the client's core is free while a step is in flight (the middle computes elsewhere)

    def step(self, step: Step, timing: StepTiming, while_waiting: Iterator[object] | None = None) -> torch.Tensor:
        """The middle's outputs for the step's hidden states, its times added to `timing`. `while_waiting` is
        client work in pieces: one piece (`next`) runs while each request of the step is in flight; the
        caller runs what remains."""
        ...


class InProcessMiddle:
    """The middle stage run in this process, with the same contract as a server session."""

    overlaps = False  # it computes on the client's own cores

    def __init__(self, stage: Stage, max_context: int) -> None:
        self.stage = stage
        self.max_context = self.max_nodes = max_context
        self.cache: KVCache = stage.new_cache(max_context)

    def step(self, step: Step, timing: StepTiming, while_waiting: Iterator[object] | None = None) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.stage(self.cache, step)
        if while_waiting is not None:  # nothing is in flight here: one piece runs, inside the step's time
            next(while_waiting, None)
        ms = (time.perf_counter() - t0) * 1000
        timing.server_ms += ms
        timing.round_trip_ms += ms  # no network in-process: the round trip is the compute
        return out


class SplitPipeline:
    """One generation's state on the client: its own caches and its middle session."""

    def __init__(self, client_model: ClientModel, middle: Middle, max_context: int) -> None:
        self.client_model = client_model
        self.middle = middle
        self.caches = client_model.new_caches(min(max_context, middle.max_context))  # what the middle granted
        self.score_ms = 0.0  # wall time spent in score() since the last take_score_ms()
        self._outputs: dict[int, torch.Tensor] = {}  # the last step's first-stage and middle outputs, by layer count

    @property
    def committed(self) -> int:
        """Positions committed in the caches (the previous step's kept entries count once kept)."""
        return self.caches.first.length

    @property
    def pending(self) -> int:
        return self.caches.first.pending

    @property
    def max_context(self) -> int:
        """Positions every cache holds, within the model's maximum position."""
        return min(self.caches.first.max_context, self.middle.max_context, self.client_model.cfg.max_position)

    @property
    def overlaps(self) -> bool:
        """Whether the client's core is free while a step is in flight, for work that can go there."""
        return self.middle.overlaps

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
        timing.nodes = step.inputs.numel()
        low = self.client_model.run_first(self.caches, step)
        t1 = time.perf_counter()
        mid = self.middle.step(step.with_inputs(low), timing, while_waiting)
        t2 = time.perf_counter()
        hidden = self.client_model.run_last(self.caches, step.with_inputs(mid))
        self._outputs = dict(zip(self.client_model.tap_layers, (low, mid)))
        t3 = time.perf_counter()
        timing.first_ms = (t1 - t0) * 1000
        timing.last_ms = (t3 - t2) * 1000
        timing.context = self.committed
        self.score_ms += (time.perf_counter() - t0) * 1000
        return hidden, timing

    def tapped(self, layers: Sequence[int]) -> torch.Tensor:
        """The last step's outputs of `layers` (among `client_model.tap_layers`) side by side: (n, len(layers) d)."""
        missing = [t for t in layers if t not in self._outputs]
        if missing:
            raise ValueError(f"this client holds the outputs of layers {list(self.client_model.tap_layers)}, not {missing}")
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
