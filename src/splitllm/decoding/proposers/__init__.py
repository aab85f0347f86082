"""Sources of candidate continuations (`Candidate`s): the tree merges them, the model decides."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from splitllm.decoding.sizing.budget import SpecBudget


@dataclass(frozen=True)
class Candidate:
    """A guess at the tokens following the last committed token.

    confidence: the proposer's estimate that the first token is right, in (0, 1]; it only ranks
    nodes when the tree must drop some, so a wrong estimate costs speed, never correctness.
    score: set by proposers that score tree nodes themselves (the drafter): the candidate then stands
    for its last token's node only, whose estimated chance of being accepted (whole path) this is.
    """

    tokens: tuple[int, ...]
    source: str
    confidence: float
    score: float | None = None


class Proposer(Protocol):
    name: str

    def propose(self, history: Sequence[int], budget: SpecBudget) -> list[Candidate]:
        """Candidates continuing `history` (prompt plus committed tokens, append-only within a generation)."""
        ...
