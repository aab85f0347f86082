"""Score a step's nodes through the whole split model: head -> middle (wire) -> tail -> LM head.

Decoders see only `SplitPipeline.score`, so the same proposers and verifier run over the network
(RemoteMiddle) or in-process (LocalMiddle, for tests and offline benchmarks).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from splitllm.client.client_model import LocalModel
from splitllm.model.kv import KVCache
from splitllm.model.stage import Stage
from splitllm.stats import StepStats
from splitllm.model.visibility import Visibility


class Middle(Protocol):
    max_context: int  # positions its cache holds (a server may grant fewer than asked)
    max_nodes: int  # positions one step may send
    overlaps: bool  # whether the client's core is free while a step is in flight (the middle computes elsewhere)

    def step(
        self, hidden: torch.Tensor, positions: torch.Tensor, vis: Visibility, keep: Sequence[int], stats: StepStats,
        while_waiting: Iterator[object] | None = None,
    ) -> torch.Tensor:
        """The middle's outputs for `hidden`. `while_waiting` is client work in pieces: one piece
        (`next`) runs while each request of the step is in flight; the caller runs what remains."""
        ...


class LocalMiddle:
    """The middle stage run in this process, with the same contract as a server session."""

    overlaps = False  # it computes on the client's own cores

    def __init__(self, stage: Stage, max_context: int) -> None:
        self.stage = stage
        self.max_context = self.max_nodes = max_context
        self.cache: KVCache = stage.new_cache(max_context)

    def step(
        self, hidden: torch.Tensor, positions: torch.Tensor, vis: Visibility, keep: Sequence[int], stats: StepStats,
        while_waiting: Iterator[object] | None = None,
    ) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.stage(self.cache, hidden, positions, vis, keep)
        if while_waiting is not None:  # nothing is in flight here: one piece runs, inside the step's time
            next(while_waiting, None)
        ms = (time.perf_counter() - t0) * 1000
        stats.server_ms += ms
        stats.round_trip_ms += ms  # no network in-process: the round trip is the compute
        return out


class SplitPipeline:
    """One generation's state on the client: its local caches and its middle session."""

    def __init__(self, local: LocalModel, middle: Middle, max_context: int) -> None:
        self.local = local
        self.middle = middle
        self.caches = local.new_caches(min(max_context, middle.max_context))  # what the middle granted
        self.score_ms = 0.0  # wall time spent in score() since the last take_score_ms()
        self._outputs: dict[int, torch.Tensor] = {}  # the last step's head and middle outputs, by layer count

    @property
    def committed(self) -> int:
        """Positions committed in the caches (the previous step's kept entries count once kept)."""
        return self.caches.head.length

    @property
    def pending(self) -> int:
        return self.caches.head.pending

    @property
    def max_context(self) -> int:
        """Positions every cache holds, within the model's maximum position."""
        return min(self.caches.head.max_context, self.middle.max_context, self.local.cfg.max_position)

    @property
    def overlaps(self) -> bool:
        """Whether the client's core is free while a step is in flight, for work that can go there."""
        return self.middle.overlaps

    def room(self, start: int) -> int:
        """How many positions a step starting at absolute position `start` may send: what the caches
        have left (and the model's last position) and the middle's per-step cap both bound it."""
        return max(min(self.max_context - start, self.middle.max_nodes), 0)

    def score(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        vis: Visibility,
        keep: Sequence[int],
        rows: torch.Tensor | None = None,
        stats: StepStats | None = None,
    ) -> tuple[torch.Tensor, StepStats]:
        """Logits for the chosen rows (all by default) after one round trip; `keep` as in Stage.forward."""
        hidden, stats = self.forward(tokens, positions, vis, keep, stats)
        return self.logits(hidden if rows is None else hidden[rows], stats), stats

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        vis: Visibility,
        keep: Sequence[int],
        stats: StepStats | None = None,
        while_waiting: Iterator[object] | None = None,
    ) -> tuple[torch.Tensor, StepStats]:
        """Hidden states leaving the tail for every node, after one round trip; no LM head yet.

        Decoders that need logits for only some nodes, decided as they go, call `logits` row by row.
        `while_waiting` is client work that needs nothing from this step (a draft model reading the
        prompt), in pieces: the middle runs one while each of its requests is in flight, where the
        client would otherwise wait; the caller runs what remains.
        """
        t0 = time.perf_counter()
        stats = stats or StepStats()
        stats.nodes = tokens.numel()
        low = self.local.run_head(self.caches, tokens, positions, vis, keep)
        t1 = time.perf_counter()
        mid = self.middle.step(low, positions, vis, keep, stats, while_waiting)
        t2 = time.perf_counter()
        hidden = self.local.run_tail(self.caches, mid, positions, vis, keep)
        self._outputs = dict(zip(self.local.tap_layers, (low, mid)))
        t3 = time.perf_counter()
        stats.head_ms = (t1 - t0) * 1000
        stats.tail_ms = (t3 - t2) * 1000
        stats.context = self.committed
        self.score_ms += (time.perf_counter() - t0) * 1000
        return hidden, stats

    def tapped(self, layers: Sequence[int]) -> torch.Tensor:
        """The last step's outputs of `layers` (among `local.tap_layers`) side by side: (n, len(layers) d)."""
        missing = [t for t in layers if t not in self._outputs]
        if missing:
            raise ValueError(f"this client holds the outputs of layers {list(self.local.tap_layers)}, not {missing}")
        return torch.cat([self._outputs[t].to(self.local.dtype) for t in layers], dim=-1)

    @property
    def shared_logit_rows(self) -> int:
        return self.local.shared_logit_rows

    def logits(self, hidden: torch.Tensor, stats: StepStats, draft: bool = False) -> torch.Tensor:
        """LM head over `hidden`'s rows, timed as part of the step's tail; `draft`: the approximate head."""
        t0 = time.perf_counter()
        out = self.local.draft_logits(hidden) if draft else self.local.logits(hidden)
        ms = (time.perf_counter() - t0) * 1000
        stats.tail_ms += ms
        self.score_ms += ms
        return out

    def take_score_ms(self) -> float:
        """Time spent scoring since the last call: what a step's wall time minus it leaves is the decoder's."""
        ms, self.score_ms = self.score_ms, 0.0
        return ms
