"""How often drafted tokens turn out right, learned as the generation goes.

A candidate is judged against the tokens actually committed after it (whether or not the tree had room
for it), so the estimates do not depend on earlier budgets. Every estimate is one `Calibration`:
hits over trials per key, shrunk toward the proposer's own guess. The n-gram candidates keep two per
kind (`CandidateRates`): their first token is right (`first`, per source and proposer confidence) and,
given the tokens so far were right, the next one is too (`next`, per source); the tree ranks nodes
by them, so a looping text earns lookup candidates deep branches while a proposer that keeps missing
loses its nodes. The drafter keeps one per bin of its own probability.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from splitllm.decoding.proposers import Candidate

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class CalibrationConfig:
    """prior_weight: pseudo-observations behind each rate's prior; prior_next: a source's prior chance
    that a candidate's next token is right given the earlier ones were; max_next keeps scores strictly
    falling along a path; drafter_bins: bins of the drafter's probability, each calibrated apart."""

    prior_weight: float = 4.0
    prior_next: float = 0.7
    max_next: float = 0.98
    drafter_bins: int = 10


class Calibration(Generic[K]):
    """P(a drafted token is right | its key): hits over trials, shrunk toward the prior it is asked with."""

    def __init__(self, prior_weight: float) -> None:
        self.prior_weight = prior_weight
        self._hits: dict[K, float] = {}
        self._trials: dict[K, float] = {}

    def rate(self, key: K, prior: float) -> float:
        w = self.prior_weight
        return (self._hits.get(key, 0.0) + prior * w) / (self._trials.get(key, 0.0) + w)

    def record(self, key: K, hits: float, trials: float) -> None:
        self._hits[key] = self._hits.get(key, 0.0) + hits
        self._trials[key] = self._trials.get(key, 0.0) + trials


class CandidateRates:
    """The (first, next) rates of each kind of n-gram candidate, from the candidates' fates in the history."""

    def __init__(self, config: CalibrationConfig = CalibrationConfig()) -> None:
        self.config = config
        self._first: Calibration[tuple[str, float]] = Calibration(config.prior_weight)
        self._next: Calibration[str] = Calibration(config.prior_weight)
        self._pending: list[tuple[int, Candidate]] = []

    def rates(self, candidate: Candidate) -> tuple[float, float]:
        """(chance the first token is right, chance each next one is, given the earlier ones were)."""
        first = self._first.rate((candidate.source, candidate.confidence), candidate.confidence)
        nxt = self._next.rate(candidate.source, self.config.prior_next)
        return max(first, 1e-3), min(nxt, self.config.max_next)

    def track(self, candidates: Sequence[Candidate], start: int) -> None:
        """Remember candidates proposed to continue the history at index `start`."""
        self._pending += [(start, d) for d in candidates]

    def resolve(self, history: Sequence[int]) -> None:
        """Score every tracked candidate whose fate the history now decides."""
        pending = []
        for start, candidate in self._pending:
            known = list(history[start : start + len(candidate.tokens)])
            matched = next((i for i, (a, b) in enumerate(zip(candidate.tokens, known)) if a != b), len(known))
            if matched == len(known) < len(candidate.tokens):
                pending.append((start, candidate))  # right so far, the rest is still to come
                continue
            self._first.record((candidate.source, candidate.confidence), matched >= 1, 1)
            self._next.record(candidate.source, max(matched - 1, 0), min(matched, len(candidate.tokens) - 1))
        self._pending = pending
