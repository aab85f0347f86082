"""How much a speculative step may send, and who decides it.

A step's cost on a CPU server grows with its node count (about 27 ms for 1 node, 42 ms for 8,
58 ms for 16, 89 ms for 32 through the default model's 26 middle layers) while the link adds a
fixed round trip; a policy weighs the two. `StaticPolicy` always answers the same budget; adaptive
policies implement the same `choose` and read the steps measured so far.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from splitllm.stats import StepStats


@dataclass(frozen=True)
class SpecBudget:
    """Limits of one step.

    max_nodes: candidate-tree nodes (draft tokens) verified per step.
    window, levels: lookahead's Jacobi window, W columns by N - 1 levels (0 columns: no window);
        it harvests n-grams of `levels + 1` tokens and costs `window * levels - 1` nodes a step.
    guesses: candidates each proposer may offer per step (lookahead's G; context-lookup matches).
    depth: longest candidate continuation, in tokens.
    """

    max_nodes: int = 8
    window: int = 0
    levels: int = 0
    guesses: int = 2
    depth: int = 8

    def __post_init__(self) -> None:
        if min(self.max_nodes, self.window, self.levels, self.guesses, self.depth) < 0:
            raise ValueError("speculation budgets are non-negative")
        if self.window and (self.window < 2 or self.levels < 2):
            raise ValueError("a lookahead window needs at least 2 columns and 2 levels")

    @property
    def window_nodes(self) -> int:
        return self.window * self.levels - 1 if self.window else 0


class BudgetPolicy(Protocol):
    def choose(self, steps: Sequence[StepStats]) -> SpecBudget:
        """The budget of the next step, given every step of this generation so far (prefill first)."""
        ...


@dataclass(frozen=True)
class StaticPolicy:
    budget: SpecBudget

    def choose(self, steps: Sequence[StepStats]) -> SpecBudget:
        return self.budget


# Static defaults for an ~80 ms link to a one-thread CPU server, chosen by measuring tokens per step
# and step cost on the benchmark workload: on such a server a lookahead window costs about as much as
# its pool n-grams save, so `auto` keeps only a small one; on a GPU or a slower link larger windows pay.
DEFAULT_BUDGETS: dict[str, SpecBudget] = {
    "lookup": SpecBudget(max_nodes=8, guesses=3, depth=8),
    "lookahead": SpecBudget(max_nodes=8, window=4, levels=2, guesses=4, depth=2),
    "auto": SpecBudget(max_nodes=8, window=2, levels=2, guesses=3, depth=8),
}
