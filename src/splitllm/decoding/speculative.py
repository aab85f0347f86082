"""Speculative greedy decoding over the split: verify many guesses per round trip, commit what the model confirms.

One step sends, in one `Scorer.forward` call:
  chain  - committed tokens with no cache entry yet (the prompt at first, then the last step's bonus token),
           causal; its last token is the step's root;
  tree   - the candidate tree hanging off the root (drafts of every proposer, merged);
  window - lookahead's Jacobi window, also hanging off the root, invisible to the tree.
The verifier walks the tree with the model's argmax; the next step's `keep` commits the chain and the
accepted nodes, so every stage compacts its cache without an extra round trip.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from splitllm.decoding.calibration import Calibration
from splitllm.decoding.policy import DEFAULT_BUDGETS, BudgetPolicy, StaticPolicy
from splitllm.decoding.proposers import Proposer
from splitllm.decoding.proposers.lookahead import LookaheadWindow, WindowLayout
from splitllm.decoding.proposers.lookup import ContextLookup
from splitllm.decoding.sampling import Sampler
from splitllm.decoding.scorer import Scorer
from splitllm.decoding.step import StepOutput
from splitllm.decoding.tree import ROOT, DraftTree
from splitllm.decoding.verifier import verify
from splitllm.stats import StepStats
from splitllm.visibility import Visibility

MODES: dict[str, tuple[str, ...]] = {
    "lookahead": ("lookahead",),
    "lookup": ("lookup",),
    "auto": ("lookup", "lookahead"),
}


@dataclass
class StepPlan:
    tokens: list[int]
    positions: list[int]
    vis: Visibility
    window_rows: list[int]


def plan_step(chain: Sequence[int], start: int, tree: DraftTree, window: WindowLayout | None) -> StepPlan:
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


def default_proposers(mode: str) -> Callable[[], list[Proposer]]:
    """A factory of fresh proposers (one set per generation: they index its history) for a mode."""
    if mode not in MODES:
        raise ValueError(f"unknown speculative mode {mode!r}; choose from {', '.join(MODES)}")
    make = {"lookahead": LookaheadWindow, "lookup": ContextLookup}
    return lambda: [make[name]() for name in MODES[mode]]


class SpeculativeDecoder:
    """A decoder (see `DECODERS`) drafting with the proposers of `mode`, sized by `policy` each step.

    `proposers` overrides the mode's proposer factory; a `LookaheadWindow` among them gets its
    Jacobi window into every step.
    """

    def __init__(
        self,
        mode: str = "auto",
        policy: BudgetPolicy | None = None,
        proposers: Callable[[], list[Proposer]] | None = None,
    ) -> None:
        self.mode = mode
        self.proposers = proposers or default_proposers(mode)
        self.policy = policy or StaticPolicy(DEFAULT_BUDGETS[mode])

    def __call__(
        self,
        pipeline: Scorer,
        prompt: list[int],
        max_new_tokens: int,
        stop_ids: Collection[int],
        sampler: Sampler | None = None,
        keep: Sequence[int] = (),
    ) -> Iterator[StepOutput]:
        """Same contract as `decode_sequential`: `prompt` is fed first, `keep` commits a previous path.

        The proposers read `sampler.history` (everything the model has seen and emitted so far, which
        the sampler extends with each emitted token), so a conversation's earlier turns feed lookups too.
        """
        sampler = sampler or Sampler(history=prompt)
        history = sampler.history
        proposers = self.proposers()
        window = next((p for p in proposers if isinstance(p, LookaheadWindow)), None)
        calibration = Calibration()
        chain, keep = list(prompt), list(keep)
        start = pipeline.committed + len(keep)
        steps: list[StepStats] = []
        remaining = max_new_tokens
        while remaining > 0:
            budget = self.policy.choose(steps)
            calibration.resolve(history)
            drafts = [d for p in proposers for d in p.propose(history, budget)]
            tree = DraftTree.build(drafts, budget.max_nodes, remaining - 1, [calibration.rates(d) for d in drafts])
            calibration.track(drafts, len(history))
            layout = None
            if window is not None and budget.window and remaining > 1:  # a last token has no future to guess
                layout = window.layout(history, budget)
            plan = plan_step(chain, start, tree, layout)
            hidden, stats = pipeline.forward(torch.tensor(plan.tokens), torch.tensor(plan.positions), plan.vis, keep)
            c = len(chain)

            def choose(node: int, candidates: list[int]) -> int:
                row = c - 1 if node == ROOT else c + node
                return sampler.choose(pipeline.logits(hidden[row : row + 1], stats)[0], candidates)

            verdict = verify(tree, choose, remaining, stop_ids)
            if layout is not None and window is not None:
                guesses = pipeline.logits(hidden[plan.window_rows], stats, draft=True).argmax(-1).tolist()
                window.advance(chain[-1], guesses)
            stats.accepted = len(verdict.tokens)
            stats.drafted = len(tree)
            stats.window = len(layout.tokens) if layout else 0
            stats.proposer = tree.sources[verdict.path[-1]][0] if verdict.path else ""
            steps.append(stats)
            keep = [*range(c), *(c + i for i in verdict.path)]
            yield StepOutput(verdict.tokens, stats, keep)
            if verdict.stopped:
                return
            remaining -= len(verdict.tokens)
            start += len(keep)
            chain = verdict.tokens[-1:]
