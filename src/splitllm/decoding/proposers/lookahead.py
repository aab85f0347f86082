"""Lookahead decoding (Fu et al. 2024): a Jacobi window rides along every step and feeds an n-gram pool.

The window holds N - 1 levels of W guessed tokens. Level 0 column 0 is the step's root (the last
committed token, not yet cached); level 0 columns 1..W-1 sit at root + i; level j >= 1 column i sits
at root + j + i. Token (j, i) sees the root, level-0 columns 1..i and levels 1..j of its own column,
so every column is a chain of guesses and the last level's greedy outputs extend it by one token.
Each step harvests one n-gram per column (its N - 1 tokens plus the output), shifts the levels up
and puts the outputs in the last level. Pool n-grams whose first token is the root become candidates.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from splitllm.decoding.sizing.budget import SpecBudget
from splitllm.decoding.proposers import Candidate


@dataclass(frozen=True)
class WindowLayout:
    """The window's nodes of one step, relative to the root.

    offsets: position of each node minus the root's; visible: node-to-node visibility inside the
    window (each node also sees the root and everything before it); outputs: the nodes whose
    greedy tokens advance the window (the last level, one per column).
    """

    tokens: list[int]
    offsets: list[int]
    visible: np.ndarray
    outputs: list[int]


class LookaheadWindow:
    """Jacobi window plus n-gram pool; a Proposer of the pool's n-grams."""

    name = "lookahead"

    def __init__(self, pool_per_key: int = 8, seed: int = 0) -> None:
        self.pool_per_key = pool_per_key
        self.pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}
        self.levels: list[list[int]] = []  # levels[0]: columns 1..W-1; levels[j >= 1]: columns 0..W-1
        self._rng = random.Random(seed)

    def propose(self, history: Sequence[int], budget: SpecBudget) -> list[Candidate]:
        grams = self.pool.get(history[-1]) if history else None
        if not grams or not budget.guesses:
            return []
        # Most recent first: the pool keeps insertion order and re-inserts a repeated n-gram.
        recent = list(reversed(grams))[: budget.guesses]
        return [Candidate(g[: budget.depth], self.name, 0.1) for g in recent if budget.depth]

    def layout(self, history: Sequence[int], budget: SpecBudget) -> WindowLayout:
        """This step's window (resized to the budget, new slots filled with tokens of the history)."""
        w, n_levels = budget.window, budget.levels
        self._resize(history, w, n_levels)
        tokens, offsets, cols, levels = [], [], [], []
        for j, row in enumerate(self.levels):
            for k, tok in enumerate(row):
                col = k + 1 if j == 0 else k
                tokens.append(tok)
                offsets.append(j + col)
                cols.append(col)
                levels.append(j)
        cols_a, levels_a = np.array(cols), np.array(levels)
        # (j, i) sees level-0 columns 1..i, and level j' in 1..j of column i.
        first = (levels_a[None, :] == 0) & (cols_a[None, :] <= cols_a[:, None])
        own = (levels_a[None, :] >= 1) & (levels_a[None, :] <= levels_a[:, None]) & (cols_a[None, :] == cols_a[:, None])
        visible = first | own
        last = len(tokens) - w
        return WindowLayout(tokens, offsets, visible, list(range(last, len(tokens))))

    def advance(self, root: int, outputs: Sequence[int]) -> None:
        """Harvest one n-gram per column, then shift the levels up and append the outputs."""
        w = len(outputs)
        columns = [[root, *self.levels[0]]] + self.levels[1:] + [list(outputs)]
        for i in range(w):
            gram = [level[i] for level in columns]
            self._remember(gram[0], tuple(gram[1:]))
        self.levels = [self.levels[1][1:]] + self.levels[2:] + [list(outputs)]

    def _remember(self, first: int, gram: tuple[int, ...]) -> None:
        grams = self.pool.setdefault(first, OrderedDict())
        grams.pop(gram, None)
        grams[gram] = None
        while len(grams) > self.pool_per_key:
            grams.popitem(last=False)

    def _resize(self, history: Sequence[int], w: int, n_levels: int) -> None:
        sizes = [w - 1] + [w] * (n_levels - 1)
        levels = self.levels[:n_levels] + [[] for _ in range(n_levels - len(self.levels))]
        self.levels = [
            (row + [self._rng.choice(history) for _ in range(size - len(row))])[:size]
            for row, size in zip(levels, sizes)
        ]
