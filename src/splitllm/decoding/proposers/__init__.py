"""Sources of candidate continuations (`Candidate`s): the tree merges them, the model decides."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from splitllm.decoding.sizing.budget import SpecBudget

if TYPE_CHECKING:
    import torch


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


class TreeDrafter(Proposer, Protocol):
    """A proposer that drafts with a model on the client and scores its tree's nodes itself (its candidates
    carry `score`): all the speculative decoder calls of a drafter. Besides proposing, it can prepare the
    next step's tree while a step is in flight, after the path that step likely accepts; that tree may go
    to the model at once as a step sent ahead (decoding/ahead.py), which the drafter then adopts or forgets."""

    taps: tuple[int, ...]  # layers whose outputs `observe` needs beside the features (none: the features alone)
    reads_tokens: bool  # drafts from tokens alone, so it can read a prefill beside the round trip (`catch_up`)
    adopted: bool  # whether the last `propose` took the tree prepared for it

    @property
    def prepared(self) -> object | None:
        """The tree prepared while the last step was in flight (None: none)."""
        ...

    def catch_up(self, history: Sequence[int]) -> Iterator[object]:
        """Read the committed `history` in, a pass per `next` (a drafter that `reads_tokens`)."""
        ...

    def observe(self, start: int, features: torch.Tensor, taps: torch.Tensor | None = None) -> None:
        """The target's last-stage outputs at newly committed positions `start`, `start + 1`, ... (and the
        outputs of `taps`' layers there)."""
        ...

    def take_draft_ms(self) -> float:
        """Time spent drafting since the last call."""
        ...

    def likely_path(self, verified: Callable[[list[int]], bool], entered: bool = False) -> tuple[list[int], float]:
        """The tokens of its last tree the step in flight likely accepts before the bonus token, and the
        chance it accepts them all (`verified`: whether the step holds a path)."""
        ...

    def prepare(self, history: Sequence[int], budget: SpecBudget, until: float) -> None:
        """Draft the tree after `history` (committed plus the likely path) into `prepared`, beginning no
        depth that would end after `until` (time.perf_counter())."""
        ...

    def send_prepared(self) -> list[Candidate]:
        """The prepared tree's nodes, for a step sent ahead now; kept until `take_sent` or `drop_sent`."""
        ...

    def take_sent(self, history: Sequence[int]) -> None:
        """The step sent ahead was taken up (`history` ends with its bonus token): drafting goes on from its tree."""
        ...

    def drop_sent(self) -> None:
        """The step sent ahead was dropped: its tree is forgotten."""
        ...
