"""Whether growing the drafter's tree pays for itself: drafting sits on the client's critical path."""

from __future__ import annotations

from dataclasses import dataclass

from splitllm.decoding.budget import NodeCost
from splitllm.stats import StepStats


@dataclass(frozen=True)
class GateConfig:
    """explore: steps between two drafting steps while drafting does not pay, doubled after each such
    try up to max_explore; decay: of the running averages; prior_gain: the tokens per drafting step
    only the drafter proposed before any step drafted (a prior worth one try)."""

    explore: int = 8
    max_explore: int = 64
    decay: float = 0.8
    prior_gain: float = 0.5


class DraftGate:
    """A step that drafts spends `draft_ms` to gain the tokens only the drafter proposed; each is worth
    the step time per token (`NodeCost.step_ms` over the tokens a step yields). Both sides are
    running averages of the steps that drafted. While drafting does not pay, a step drafts anyway
    now and then, so a drafter that starts paying (a text it knows) gets its trees back; each try that
    finds it still not paying waits twice as long for the next, since on a fast link a try costs a
    sizeable share of a step. The drafter catches up on the committed positions when it next drafts.
    """

    def __init__(self, config: GateConfig = GateConfig()) -> None:
        self.config = config
        self.gain = config.prior_gain  # tokens per drafting step only the drafter proposed
        self.ms = 0.0  # drafting time per drafting step
        self.tokens = 1.0  # tokens per step
        self.interval = config.explore  # steps from one try to the next while drafting does not pay
        self.next_try = 0  # the step of the next try

    def worth(self, cost: NodeCost, step: int) -> bool:
        if self.gain * cost.step_ms / self.tokens >= self.ms:
            self.interval = self.config.explore
            return True
        if step < self.next_try:
            return False
        self.next_try = step + self.interval
        self.interval = min(2 * self.interval, self.config.max_explore)
        return True

    def observe(self, stats: StepStats, drafted: bool) -> None:
        d = self.config.decay
        self.tokens = d * self.tokens + (1 - d) * stats.accepted
        if drafted:
            self.gain = d * self.gain + (1 - d) * stats.sources.get("draft", 0)
            self.ms = d * self.ms + (1 - d) * stats.draft_ms
