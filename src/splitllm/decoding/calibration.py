"""How often each kind of draft turns out right, learned as the generation goes.

A draft is judged against the tokens actually committed after it (whether or not the tree had
room for it), so the estimates do not depend on earlier budgets. Two rates per draft kind: its
first token is right (`first`, per source and proposer confidence) and, given the tokens so far
were right, the next one is too (`next`, per source). The tree ranks nodes by them, so a looping
text earns lookup drafts deep branches while a proposer that keeps missing loses its nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from splitllm.decoding.proposers import Draft

PRIOR_WEIGHT = 4.0  # pseudo-observations behind the prior of each rate
PRIOR_NEXT = 0.7
MAX_NEXT = 0.98  # keeps scores strictly falling along a path


@dataclass
class Rate:
    prior: float
    hits: float = 0.0
    trials: float = 0.0

    @property
    def value(self) -> float:
        return (self.hits + self.prior * PRIOR_WEIGHT) / (self.trials + PRIOR_WEIGHT)


class Calibration:
    def __init__(self) -> None:
        self._first: dict[tuple[str, float], Rate] = {}
        self._next: dict[str, Rate] = {}
        self._pending: list[tuple[int, Draft]] = []

    def rates(self, draft: Draft) -> tuple[float, float]:
        """(chance the first token is right, chance each next one is, given the earlier ones were)."""
        first = self._first.get((draft.source, draft.confidence), Rate(draft.confidence)).value
        nxt = self._next.get(draft.source, Rate(PRIOR_NEXT)).value
        return max(first, 1e-3), min(nxt, MAX_NEXT)

    def track(self, drafts: Sequence[Draft], start: int) -> None:
        """Remember drafts proposed to continue the history at index `start`."""
        self._pending += [(start, d) for d in drafts]

    def resolve(self, history: Sequence[int]) -> None:
        """Score every tracked draft whose fate the history now decides."""
        pending = []
        for start, draft in self._pending:
            known = list(history[start : start + len(draft.tokens)])
            matched = next((i for i, (a, b) in enumerate(zip(draft.tokens, known)) if a != b), len(known))
            if matched == len(known) < len(draft.tokens):
                pending.append((start, draft))  # right so far, the rest is still to come
                continue
            first = self._first.setdefault((draft.source, draft.confidence), Rate(draft.confidence))
            first.trials += 1
            first.hits += matched >= 1
            nxt = self._next.setdefault(draft.source, Rate(PRIOR_NEXT))
            nxt.trials += min(matched, len(draft.tokens) - 1)
            nxt.hits += max(matched - 1, 0)
        self._pending = pending
