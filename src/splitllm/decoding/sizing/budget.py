"""How much a speculative step may send, and what its tree nodes cost.

A step's cost on a CPU server grows with its node count while the link adds a fixed round trip;
the policies (policies.py) weigh the two and answer a `SpecBudget` per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeCost:
    """What verifying tree nodes costs at the current link, to size trees by value.

    step_ms: a step's time with no tree (round trip, server and client compute of the fixed part);
    node_ms: what each tree node adds (client first- and last-stage rows, server rows, bytes on the wire).
    A node with an estimated acceptance chance s raises a step's expected tokens A by s and its
    time T by node_ms, which raises tokens per second A / T exactly when s * T / A > node_ms: its
    chance times what a token is worth at this link (T / A ms) must exceed what it costs.
    """

    step_ms: float
    node_ms: float

    def worth(self, scores: Sequence[float]) -> int:
        """How many of the nodes, best first (descending `scores`), to verify."""
        accepted, ms = 1.0, self.step_ms
        for i, s in enumerate(scores):
            if s * ms <= accepted * self.node_ms:
                return i
            accepted, ms = accepted + s, ms + self.node_ms
        return len(scores)


@dataclass(frozen=True)
class SpecBudget:
    """Limits of one step.

    max_nodes: candidate-tree nodes (draft tokens) verified per step.
    window, levels: lookahead's Jacobi window, W columns by N - 1 levels (0 columns: no window);
        it harvests n-grams of `levels + 1` tokens and costs `window * levels - 1` nodes a step.
    guesses: candidates each proposer may offer per step (lookahead's G; context-lookup matches).
    depth: longest candidate continuation, in tokens.
    cost: when set, the tree keeps only the nodes worth verifying (up to max_nodes).
    """

    max_nodes: int = 8
    window: int = 0
    levels: int = 0
    guesses: int = 2
    depth: int = 8
    cost: NodeCost | None = None

    def __post_init__(self) -> None:
        if min(self.max_nodes, self.window, self.levels, self.guesses, self.depth) < 0:
            raise ValueError("speculation budgets are non-negative")
        if self.window and (self.window < 2 or self.levels < 2):
            raise ValueError("a lookahead window needs at least 2 columns and 2 levels")

    @property
    def window_nodes(self) -> int:
        return self.window * self.levels - 1 if self.window else 0


# Static budgets for an ~80 ms link to a one-thread CPU server, chosen by measuring tokens per step
# and step cost on the benchmark workload: on such a server a lookahead window costs about as much as
# its pool n-grams save, so `auto` keeps only a small one; on a GPU or a slower link larger windows pay.
LOOKUP_BUDGET = SpecBudget(max_nodes=8, guesses=3, depth=8)
LOOKAHEAD_BUDGET = SpecBudget(max_nodes=8, window=4, levels=2, guesses=4, depth=2)
AUTO_BUDGET = SpecBudget(max_nodes=8, window=2, levels=2, guesses=3, depth=8)
DRAFTER_BUDGET = SpecBudget(max_nodes=24, guesses=3, depth=8)  # steps the drafter drafts in
VALUE_BUDGET = SpecBudget(max_nodes=64, guesses=3, depth=10)  # the cap under trees sized by value
