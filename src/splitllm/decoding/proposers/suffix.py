"""Drafting from earlier requests: what followed the latest few tokens when an earlier generation wrote them.

Agents and coding sessions repeat themselves across requests (the same tool-call frame, a function
rewritten with one change, a question asked again), which a generation's own history cannot see.
`SuffixCache` keeps the token sequences of earlier generations (their new prompt tokens and their
answers) and `SuffixLookup` proposes their continuations, as SuffixDecoding does with a suffix tree; an
n-gram index does the same lookups in a few lines at these sizes. The cache belongs to one owner (one
API key, or one user's client): what another principal wrote never drafts for them, since how many
tokens a step accepts would tell them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from splitllm.decoding.proposers import Candidate
from splitllm.decoding.proposers.lookup import confidence
from splitllm.decoding.sizing.budget import SpecBudget

MAX_TOKENS = 1 << 14  # an agentic session's last several requests; its index takes up to about 20 MiB


class SuffixCache:
    """Earlier generations' token sequences, the oldest dropped past `max_tokens`, indexed by every n-gram
    (min_ngram <= n <= max_ngram) to the places it ended; a lookup reads an n-gram's `recent` newest places."""

    # Three tokens at least: across unrelated requests two-token matches ("of the") mostly propose what is
    # rejected, which costs the server rows.
    def __init__(self, max_tokens: int = MAX_TOKENS, max_ngram: int = 4, min_ngram: int = 3, recent: int = 16) -> None:
        if max_tokens < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError("a suffix cache holds at least one token and looks up n-grams of 1 <= min <= max")
        self.max_tokens, self.max_ngram, self.min_ngram, self.recent = max_tokens, max_ngram, min_ngram, recent
        self._sequences: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # by number, oldest first
        self._ends: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # n-gram -> (sequence, index after it)
        self._next = 0
        self.tokens = 0  # held in `_sequences`
        self._dead = 0  # index entries of dropped sequences, swept when they outnumber the live ones

    def __len__(self) -> int:
        return len(self._sequences)

    def add(self, tokens: Sequence[int]) -> None:
        """Keep a generation's tokens (its last `max_tokens` if longer), dropping the oldest past the bound."""
        sequence = tuple(tokens[-self.max_tokens :])
        if len(sequence) <= self.min_ngram:
            return
        number, self._next = self._next, self._next + 1
        self._sequences[number] = sequence
        self.tokens += len(sequence)
        for end in range(self.min_ngram, len(sequence)):  # an n-gram ending at the last token has no continuation
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._ends.setdefault(sequence[end - n : end], []).append((number, end))
        while self.tokens > self.max_tokens:
            _, dropped = self._sequences.popitem(last=False)
            self.tokens -= len(dropped)
            self._dead += len(dropped) * (self.max_ngram - self.min_ngram + 1)
        if self._dead > self.tokens * (self.max_ngram - self.min_ngram + 1):
            self._sweep()

    def _sweep(self) -> None:
        self._ends = {key: kept for key, ends in self._ends.items()
                      if (kept := [e for e in ends if e[0] in self._sequences])}
        self._dead = 0

    def continuations(self, history: Sequence[int], depth: int, limit: int) -> list[tuple[tuple[int, ...], int]]:
        """Up to `limit` distinct continuations of `history`'s end, each `depth` tokens or fewer where its
        sequence ended, with the length of the match: the longest matches first, the newest first."""
        found: list[tuple[tuple[int, ...], int]] = []
        seen: set[tuple[int, ...]] = set()
        for n in range(min(self.max_ngram, len(history)), self.min_ngram - 1, -1):
            for number, end in reversed(self._ends.get(tuple(history[-n:]), [])[-self.recent :]):
                sequence = self._sequences.get(number)
                if sequence is None:
                    continue
                tokens = sequence[end : end + depth]
                if tokens in seen:
                    continue
                seen.add(tokens)
                found.append((tokens, n))
                if len(found) == limit:
                    return found
        return found


class SuffixLookup:
    """A proposer over an owner's `SuffixCache`: the continuations of the history's end found there."""

    name = "suffix"

    def __init__(self, cache: SuffixCache) -> None:
        self.cache = cache

    def propose(self, history: Sequence[int], budget: SpecBudget) -> list[Candidate]:
        if not budget.guesses or not budget.depth:
            return []
        return [Candidate(tokens, self.name, confidence(n))
                for tokens, n in self.cache.continuations(history, budget.depth, budget.guesses)]
