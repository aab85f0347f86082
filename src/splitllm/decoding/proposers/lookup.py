"""Context lookup: the text so far often repeats itself (code, lists, a small model's loops).

Find earlier occurrences of the latest suffix in the prompt and the generated text, longest
suffix first and the most recent occurrence first, and propose what followed each of them.
"""

from __future__ import annotations

from collections.abc import Sequence

from splitllm.decoding.sizing.budget import SpecBudget
from splitllm.decoding.proposers import Candidate


class ContextLookup:
    """An index of every n-gram (n <= max_ngram) of the history to the positions that followed it.

    The index grows with the history (append-only), so a step costs O(max_ngram) lookups.
    """

    name = "lookup"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, recent: int = 8) -> None:
        self.max_ngram, self.min_ngram, self.recent = max_ngram, min_ngram, recent
        self._follows: dict[tuple[int, ...], list[int]] = {}
        self._indexed = 0

    def _index(self, history: Sequence[int]) -> None:
        for t in range(max(self._indexed, 1), len(history)):
            for n in range(1, min(self.max_ngram, t) + 1):
                self._follows.setdefault(tuple(history[t - n : t]), []).append(t)
        self._indexed = len(history)

    @staticmethod
    def continuation(history: Sequence[int], start: int, depth: int) -> tuple[int, ...]:
        """What followed position `start`, extended periodically past the end of the history.

        A match ending close to the end means the text is looping with period len - start; the
        guess is that it keeps doing so.
        """
        period = len(history) - start
        return tuple(history[start + i % period] for i in range(depth))

    def propose(self, history: Sequence[int], budget: SpecBudget) -> list[Candidate]:
        if not budget.guesses or not budget.depth:
            return []
        self._index(history)
        candidates: list[Candidate] = []
        seen: set[tuple[int, ...]] = set()
        for n in range(min(self.max_ngram, len(history)), self.min_ngram - 1, -1):
            for start in reversed(self._follows.get(tuple(history[-n:]), [])[-self.recent :]):
                tokens = self.continuation(history, start, budget.depth)
                if tokens in seen:
                    continue
                seen.add(tokens)
                candidates.append(Candidate(tokens, self.name, confidence(n)))
                if len(candidates) == budget.guesses:
                    return candidates
        return candidates


def confidence(match: int) -> float:
    """Rough chance that a suffix match of `match` tokens predicts the next token."""
    return {1: 0.25, 2: 0.45, 3: 0.6}.get(match, 0.75)
