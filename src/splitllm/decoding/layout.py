"""A speculative step as it goes to the model: the committed chain, the candidate tree and lookahead's
window laid out as one step (`plan_step`), and what the decoder keeps of a step it sent (`SentStep`)
until the model's verdict comes back.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from splitllm.decoding.proposers.lookahead import WindowLayout
from splitllm.decoding.sizing.budget import SpecBudget
from splitllm.decoding.tree import ROOT, CandidateTree
from splitllm.decoding.verifier import Verdict
from splitllm.model.stage import Step
from splitllm.model.visibility import Visibility
from splitllm.stats import StepSpeculation, StepTiming


@dataclass
class StepPlan:
    """A step's token ids, positions and visibility, chain first; `window_rows`: the rows of the window's
    outputs, which move the window on."""

    tokens: list[int]
    positions: list[int]
    vis: Visibility
    window_rows: list[int]

    def step(self, keep: Sequence[int]) -> Step:
        """The step to send, its `keep` committing entries of the step before it."""
        return Step(torch.tensor(self.tokens), torch.tensor(self.positions), self.vis, keep)


def plan_step(chain: Sequence[int], start: int, tree: CandidateTree, window: WindowLayout | None) -> StepPlan:
    """Lay out chain, tree and window as one step starting at absolute position `start`."""
    c, t = len(chain), len(tree)
    root = start + c - 1
    parents = [*range(-1, c - 1), *(c - 1 if p == ROOT else c + p for p in tree.parents)]
    tokens = [*chain, *tree.tokens]
    positions = [*range(start, start + c), *(root + d for d in tree.depths)]
    vis = Visibility.from_parents(parents)  # travels as parent indices when there is no window
    if window is None:
        return StepPlan(tokens, positions, vis, [])
    n = c + t + len(window.tokens)
    matrix = np.zeros((n, n), dtype=bool)
    matrix[: c + t, : c + t] = vis.matrix.numpy()
    matrix[c + t :, :c] = True
    matrix[c + t :, c + t :] = window.visible
    tokens += window.tokens
    positions += [root + o for o in window.offsets]
    return StepPlan(tokens, positions, Visibility.from_matrix(matrix), [c + t + r for r in window.outputs])


def fit_window(budget: SpecBudget, room: int) -> SpecBudget:
    """The budget with its lookahead window shrunk to at most `room` nodes (none if even 2 x 2 is too big)."""
    if budget.window_nodes <= room:
        return budget
    sizes = [(w, n) for w in range(budget.window, 1, -1) for n in range(budget.levels, 1, -1) if w * n - 1 <= room]
    w, n = max(sizes, key=lambda s: (s[0] * s[1], s[0]), default=(0, 0))
    return replace(budget, window=w, levels=n)


@dataclass
class SentStep:
    """A step sent: its tree and window, their layout after `chain` (the committed tokens it feeds) from
    absolute position `start`, the budget that sized it, the drafter that grew it (None: none) and its
    timing since it was sent. A step sent ahead hangs from `graft`, a node of the step before it, and
    feeds no chain; once taken up, `entry` is its first-level node the model chose (the walk starts there)."""

    tree: CandidateTree
    layout: WindowLayout | None
    plan: StepPlan
    chain: list[int]
    start: int
    budget: SpecBudget
    grew: int | None
    timing: StepTiming
    graft: int = ROOT
    entry: int = ROOT

    def walk(self, tokens: Sequence[int]) -> list[int] | None:
        """The tree's nodes along `tokens` from the walk's start (a taken-up step's tokens begin with its
        entry's), or None if the tree does not hold them."""
        node, nodes = self.entry, []
        if self.entry != ROOT:
            if tokens[:1] != [self.tree.tokens[self.entry]]:
                return None
            tokens = tokens[1:]
        for token in tokens:
            found = self.tree.child(node, token)
            if found is None:
                return None
            nodes.append(node := found)
        return nodes


def speculation_of(flight: SentStep, verdict: Verdict, prepared: bool, adopted: bool,
                   sent_ahead: bool) -> StepSpeculation:
    """What a step speculated and what of it the model confirmed; `prepared`: the next step's tree was
    prepared while it was in flight, `adopted`: its tree was the one prepared while the last step was,
    `sent_ahead`: the next step went to the server meanwhile. A step sent ahead and taken up leads its
    path with its entry node, whose token the step before emitted (so it counts there)."""
    tree, accepted = flight.tree, verdict.path[1:] if flight.entry != ROOT else verdict.path
    return StepSpeculation(
        accepted=len(verdict.tokens),
        drafted=len(tree),
        window=len(flight.layout.tokens) if flight.layout else 0,
        proposer=tree.sources[accepted[-1]][0] if accepted else "",
        sources=dict(Counter("+".join(sorted(tree.sources[i])) for i in accepted)),
        prepared=int(prepared),
        adopted=int(adopted),
        sent_ahead=int(sent_ahead),
        ran_ahead=int(flight.entry != ROOT),
    )
