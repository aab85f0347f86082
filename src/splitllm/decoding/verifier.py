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
    handoff: bool = False  # the bonus is a first-level node of the step sent ahead: the walk goes on there


@dataclass(frozen=True)
class Graft:
    """A step sent ahead hangs its tree from `node`: its first-level `tokens` are children there too."""

    node: int
    tokens: tuple[int, ...]


def verify(
    tree: CandidateTree,
    choose: Callable[[int, list[int]], int],
    limit: int,
    stop_ids: Collection[int],
    start: int = ROOT,
    graft: Graft | None = None,
) -> Verdict:
    """Commit at most `limit` tokens; `choose(node, children)` is the token emitted at a node (ROOT:
    the step's root) given its children's tokens: the argmax for greedy decoding.

    The walk begins at `start`: the root, or a node whose token is emitted already (it leads the
    path). At `graft`'s node the step sent ahead's first level offers children too, asked for once
    with the tree's own (a token in both stays in this tree, whose logits are here already); choosing
    one of them ends the walk with `handoff`, and the walk goes on in that step's tree.

    Logits are asked for one node at a time, only along the accepted path, so a step pays the LM
    head once per committed token, like sequential decoding.
    """
    tokens: list[int] = []
    path: list[int] = [] if start == ROOT else [start]
    node = start
    while True:
        own = tree.child_tokens(node)
        ahead = [t for t in graft.tokens if t not in own] if graft is not None and graft.node == node else []
        token = choose(node, [*own, *ahead])
        tokens.append(token)
        if token in stop_ids:
            return Verdict(tuple(tokens), tuple(path), stopped=True)
        nxt = tree.child(node, token)
        if len(tokens) >= limit or nxt is None:
            return Verdict(tuple(tokens), tuple(path), handoff=token in ahead and len(tokens) < limit)
        path.append(nxt)
        node = nxt
