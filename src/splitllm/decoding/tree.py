"""Merge candidates into one token tree (shared prefixes once) and cut it to a node budget.

A node's score estimates its chance of being accepted: each candidate through it adds the chance that
its tokens are right up to that depth, `first * next ** (depth - 1)` (sizing/calibration.py learns the
rates; by default the candidate's confidence and a fixed decay); a node a proposer scored itself (the
drafter's) adds that score. Scores never rise along a path (ties go to the earlier node, a
parent), so keeping the best nodes always keeps a node's ancestors too. How many: at most
`max_nodes`, and with a `NodeCost` only those worth their verification (see sizing/budget.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from splitllm.decoding.sizing.budget import NodeCost
from splitllm.decoding.proposers import Candidate

ROOT = -1
DEPTH_DECAY = 0.8


@dataclass
class CandidateTree:
    """Nodes in an order where parents come first; parent ROOT hangs a node off the step's root."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    sources: list[tuple[str, ...]] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # each node's estimated chance of being accepted
    _children: dict[int, dict[int, int]] = field(default_factory=dict, repr=False)  # node -> token -> child

    def __len__(self) -> int:
        return len(self.tokens)

    def child(self, node: int, token: int) -> int | None:
        return self._children.get(node, {}).get(token)

    def child_tokens(self, node: int) -> list[int]:
        """Tokens of a node's children."""
        return list(self._children.get(node, ()))

    def add(self, parent: int, token: int, sources: tuple[str, ...], score: float = 0.0) -> int:
        self._children.setdefault(parent, {})[token] = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent == ROOT else self.depths[parent] + 1)
        self.sources.append(sources)
        self.scores.append(score)
        return len(self.tokens) - 1

    def likeliest_below(self, node: int, n: int) -> list[int]:
        """`node` and up to n - 1 of its descendants down its likeliest children: the rows a walk that
        reached `node` most likely asks for next."""
        path = [node]
        while len(path) < n:
            children = list(self._children.get(path[-1], {}).values())
            if not children:
                break
            path.append(max(children, key=lambda c: (self.scores[c], -c)))
        return path

    @classmethod
    def build(
        cls,
        candidates: Sequence[Candidate],
        max_nodes: int,
        max_depth: int,
        rates: Sequence[tuple[float, float]] | None = None,
        cost: NodeCost | None = None,
    ) -> CandidateTree:
        """The best `max_nodes` nodes of the trie of `candidates`, each cut to `max_depth` tokens, fewer
        when `cost` says the rest would slow the step down more than they are likely to add.

        rates[i]: (first, next) acceptance rates of candidates[i], with 0 < first and 0 <= next < 1.
        """
        trie = cls()
        scores: list[float] = []
        for i, candidate in enumerate(candidates):
            first, nxt = rates[i] if rates is not None else (candidate.confidence, DEPTH_DECAY)
            node = ROOT
            if candidate.score is not None and len(candidate.tokens) > max_depth:
                continue
            for depth, token in enumerate(candidate.tokens[:max_depth], start=1):
                child = trie.child(node, token)
                if child is None:
                    child = trie.add(node, token, ())
                    scores.append(0.0)
                if candidate.score is None or depth == len(candidate.tokens):
                    if candidate.source not in trie.sources[child]:
                        trie.sources[child] += (candidate.source,)
                    scores[child] += first * nxt ** (depth - 1) if candidate.score is None else candidate.score
                node = child
        best = sorted(range(len(trie)), key=lambda i: (-scores[i], i))[: max(max_nodes, 0)]
        if cost is not None:
            best = best[: cost.worth([scores[i] for i in best])]
        tree, renumber = cls(), {ROOT: ROOT}
        for i in sorted(best):  # trie order has parents first
            renumber[i] = tree.add(renumber[trie.parents[i]], trie.tokens[i], trie.sources[i], scores[i])
        return tree
