"""Greedy verification: accept the longest tree path whose tokens equal the model's argmax, plus one.

Walking from the root, the greedy token at the current node is committed; if a child carries that
token, its logits (computed in the same step, over exactly the committed prefix) give the next
token. Every committed token is thus the argmax of the model over the committed prefix, which is
what sequential greedy decoding commits (docs/correctness.md). The token at a node comes from the
generation's sampler, which given the children's tokens also implements sampled verification.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from splitllm.decoding.tree import ROOT, CandidateTree


@dataclass(frozen=True)
class Verdict:
    tokens: tuple[int, ...]  # committed this step: the accepted nodes' tokens plus the bonus
    path: tuple[int, ...]  # accepted tree nodes, root first; their cache entries are kept
    stopped: bool = False  # a stop token was committed


def verify(
    tree: CandidateTree, choose: Callable[[int, list[int]], int], limit: int, stop_ids: Collection[int]
) -> Verdict:
    """Commit at most `limit` tokens; `choose(node, children)` is the token emitted at a node (ROOT:
    the step's root) given its children's tokens: the argmax for greedy decoding.

    Logits are asked for one node at a time, only along the accepted path, so a step pays the LM
    head once per committed token, like sequential decoding.
    """
    tokens: list[int] = []
    path: list[int] = []
    node = ROOT
    while True:
        token = choose(node, tree.child_tokens(node))
        tokens.append(token)
        if token in stop_ids:
            return Verdict(tuple(tokens), tuple(path), stopped=True)
        nxt = tree.child(node, token)
        if len(tokens) >= limit or nxt is None:
            return Verdict(tuple(tokens), tuple(path))
        path.append(nxt)
        node = nxt
