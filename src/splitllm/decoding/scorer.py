"""What a decoder needs from the model: score a step's nodes in one round trip.

Decoders own this interface so they depend on no client code; the client's `SplitPipeline`
(over a server or an in-process middle) is the implementation. It comes in three parts, named by who
calls them: `Scoring` (every decoder), `SendingAhead` (besides, steps sent ahead of the one in flight:
decoding/ahead.py) and `Tapping` (what the drafters read besides the tokens).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from splitllm.drafting.drafter_proposer import DraftingClient
from splitllm.stats import StepTiming
from splitllm.model.stage import Step


class Scoring(Protocol):
    """A generation's caches and the middle session behind them, scored a step at a time."""

    @property
    def committed(self) -> int:
        """Positions committed in the caches."""
        ...

    @property
    def max_context(self) -> int:
        """Positions every cache holds, within the model's maximum position."""
        ...

    @property
    def row_invariant(self) -> bool:
        """Whether every part of the model gives a position the same bits in a step of any size."""
        ...

    def room(self, start: int) -> int:
        """How many positions a step starting at absolute position `start` may send."""
        ...

    def score(
        self, step: Step, rows: torch.Tensor | None = None, timing: StepTiming | None = None
    ) -> tuple[torch.Tensor, StepTiming]:
        """Logits for the chosen rows of a step of token ids after one round trip; its `keep` commits the
        previous step's entries."""
        ...

    def forward(
        self, step: Step, timing: StepTiming | None = None, while_waiting: Iterator[object] | None = None
    ) -> tuple[torch.Tensor, StepTiming]:
        """Hidden states leaving the last stage for every node, after one round trip; pieces of `while_waiting`
        (work that needs nothing from this step) run while the middle computes, the rest is the caller's."""
        ...

    @property
    def shared_logit_rows(self) -> int:
        """How many rows' logits one call gives for about the cost of one row's (their bits the same as alone)."""
        ...

    def logits(self, hidden: torch.Tensor, timing: StepTiming) -> torch.Tensor:
        """LM head over `hidden`'s rows."""
        ...

    def approx_logits(self, hidden: torch.Tensor, timing: StepTiming) -> torch.Tensor:
        """An approximate LM head over `hidden`'s rows, for guesses that are never committed unverified."""
        ...


class SendingAhead(Scoring, Protocol):
    """A scorer that also takes steps sent ahead of the one in flight (decoding/ahead.py), and runs work
    meanwhile."""

    @property
    def overlaps(self) -> bool:
        """Whether the client's core is free while a step is in flight (the middle runs elsewhere)."""
        ...

    @property
    def ahead_ready(self) -> bool:
        """Whether a step may go ahead of the one in flight now (from a piece of `while_waiting`)."""
        ...

    def send_ahead(self, step: Step, timing: StepTiming) -> None:
        """Send a step whose keep picks from the step in flight's entries before its reply comes back."""
        ...

    def receive_ahead(self, timing: StepTiming, while_waiting: Iterator[object] | None = None) -> torch.Tensor:
        """Hidden states for the step sent ahead (its outcome came true): it becomes the last step."""
        ...

    def drop_ahead(self) -> None:
        """Give up the step sent ahead; the next step's keep picks from the step before it, as if it never went."""
        ...


class Tapping(Protocol):
    """What the drafters read from the model besides the tokens."""

    client_model: DraftingClient  # what the drafters draft with

    def tapped(self, layers: Sequence[int]) -> torch.Tensor:
        """The last step's outputs of the client's first stage and the middle, by layer count, side by side."""
        ...


class Scorer(SendingAhead, Tapping, Protocol):
    """All a speculative decoder calls of the model."""
