"""What the adaptive policy starts from: a fitted latency profile and each candidate budget's measured yield.

A bigger tree buys more tokens per step (measured per candidate budget: `BudgetYield.accepted`) and costs
more compute and bytes (the fitted `LatencyProfile`); the round trip is paid either way. So the best
budget depends on the link: small on a fast link to a CPU server, large over a slow WAN.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

from splitllm.decoding.sizing.budget import SpecBudget
from splitllm.decoding.sizing.latency import Breakdown, LatencyProfile, Link, StepShape

# Shipped next to this module; `splitllm bench sweep --out OUT` writes a new one to OUT/auto_profile.json.
DEFAULT_PROFILE = "auto_profile.json"

# What `auto` may choose from, smallest first: plain decoding (one node), context lookup only, then
# trees and lookahead windows of growing size. Each sends at most 1 + max_nodes + window_nodes nodes.
CANDIDATE_BUDGETS = (
    SpecBudget(max_nodes=0, window=0, levels=0, guesses=0, depth=0),
    SpecBudget(max_nodes=3, guesses=1, depth=3),
    SpecBudget(max_nodes=8, window=3, levels=2, guesses=2, depth=8),
    SpecBudget(max_nodes=16, window=4, levels=3, guesses=3, depth=8),
    SpecBudget(max_nodes=32, window=6, levels=3, guesses=4, depth=12),
)


@dataclass(frozen=True)
class BudgetYield:
    """A budget the policy may pick and what it yields per decode step, as measured on a workload."""

    budget: SpecBudget
    nodes: float
    accepted: float
    windowed: float = 0.0  # share of its steps that carried a lookahead window
    single: float = 0.0  # share of its steps with one position (nothing to draft)

    def shape(self, context: float, gain: float = 1.0) -> StepShape:
        """This budget's step at a context, its extra tokens per step scaled by `gain`."""
        return StepShape.at(self.nodes, context, 1 + gain * (self.accepted - 1), self.windowed, self.single)


@dataclass
class AutoProfile:
    """A latency profile and the candidates' measured yields, saved as JSON."""

    latency: LatencyProfile
    candidates: list[BudgetYield]
    decoder: str = "auto"

    def to_json(self) -> dict:
        return {
            "decoder": self.decoder,
            "latency": self.latency.to_json(),
            "candidates": [{**asdict(c), "budget": asdict(c.budget)} for c in self.candidates],
        }

    @classmethod
    def from_json(cls, data: dict) -> AutoProfile:
        candidates = [BudgetYield(**{**c, "budget": SpecBudget(**c["budget"])}) for c in data["candidates"]]
        return cls(LatencyProfile.from_json(data["latency"]), candidates, data.get("decoder", "auto"))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2))

    @classmethod
    def load(cls, path: str | Path | None = None) -> AutoProfile:
        """A saved profile, or the one shipped with the package (default model on a 2-core CPU)."""
        if path is None:
            return cls.from_json(json.loads(resources.files(__package__).joinpath(DEFAULT_PROFILE).read_text()))
        return cls.from_json(json.loads(Path(path).read_text()))

    def predict(self, candidate: BudgetYield, link: Link, context: float) -> Breakdown:
        return self.latency.predict(candidate.shape(context), link, self.decoder)

    def best(self, link: Link, context: float) -> tuple[BudgetYield, Breakdown]:
        """The candidate a policy with no live corrections would pick on this link."""
        scored = [(c, self.predict(c, link, context)) for c in self.candidates]
        return max(scored, key=lambda cb: cb[1].tokens_per_second)
