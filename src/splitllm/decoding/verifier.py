"""Greedy verification: accept the longest tree path whose tokens equal the model's argmax, plus one.

Walking from the root, the greedy token at the current node is committed; if a child carries that
token, its logits (computed in the same step, over exactly the committed prefix) give the next
token. Every committed token is thus the argmax of the model over the committed prefix, which is
what sequential greedy decoding commits (docs/correctness.md). The token at a node comes from the
generation's sampler, which given the children's tokens also implements sampled verification.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from splitllm.decoding.tree import ROOT, DraftTree


@dataclass
class Verdict:
    tokens: list[int] = field(default_factory=list)  # committed this step: the accepted drafts plus the bonus
    path: list[int] = field(default_factory=list)  # accepted tree nodes, root first; their cache entries are kept
    stopped: bool = False  # a stop token was committed


def verify(
    tree: DraftTree, choose: Callable[[int, list[int]], int], limit: int, stop_ids: Collection[int]
) -> Verdict:
    """Commit at most `limit` tokens; `choose(node, candidates)` is the token emitted at a node (ROOT:
    the step's root) given its children's tokens: the argmax for greedy decoding.

    Logits are asked for one node at a time, only along the accepted path, so a step pays the LM
    head once per committed token, like sequential decoding.
    """
    verdict, node = Verdict(), ROOT
    while True:
        token = choose(node, tree.candidates(node))
        verdict.tokens.append(token)
        if token in stop_ids:
            verdict.stopped = True
            return verdict
        if len(verdict.tokens) >= limit:
            return verdict
        nxt = tree.child(node, token)
        if nxt is None:
            return verdict
        verdict.path.append(nxt)
        node = nxt
