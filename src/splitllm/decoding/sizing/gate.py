"""Whether growing a drafter's tree pays for itself, and which drafter's pays most: drafting sits on the
client's critical path."""

from __future__ import annotations

from dataclasses import dataclass

from splitllm.decoding.sizing.budget import NodeCost
from splitllm.stats import StepSpeculation


@dataclass(frozen=True)
class GateConfig:
    """explore: steps between two drafting steps while drafting does not pay, doubled after each such
    try up to max_explore; decay: of the running averages; prior_gain: the tokens per drafting step
    only the drafter proposed before any step drafted (a prior worth one try)."""

    explore: int = 8
    max_explore: int = 64
    decay: float = 0.8
    prior_gain: float = 0.5


class _Tries:
    """The steps that try something anyway while it does not pay: the first at once, each later one twice
    as far after the last (up to `longest`); once it pays, the waits start over."""

    def __init__(self, first: int, longest: int) -> None:
        self.first, self.longest = first, longest
        self.interval = first  # steps from one try to the next
        self.next_try = 0  # the step of the next try

    def paid(self) -> None:
        self.interval = self.first

    def due(self, step: int) -> bool:
        if step < self.next_try:
            return False
        self.next_try = step + self.interval
        self.interval = min(2 * self.interval, self.longest)
        return True


class DraftGate:
    """One drafter's gate. A step that drafts spends `draft_ms` to gain the tokens only the drafter
    proposed; each is worth the step time per token (`NodeCost.step_ms` over the tokens a step
    yields). Both sides are running averages of the steps it drafted. While drafting does not pay, a
    step drafts anyway now and then, so a drafter that starts paying (a text it knows) gets its trees
    back; each try that finds it still not paying waits twice as long for the next, since on a fast
    link a try costs a sizeable share of a step. The drafter catches up on the committed positions
    when it next drafts. Of several drafters that pay, the one that saves the most drafts (a big draft
    model over a slow link, a small learned drafter over a fast one).
    """

    def __init__(self, config: GateConfig = GateConfig()) -> None:
        self.config = config
        self.gain = config.prior_gain  # tokens per drafting step only the drafter proposed
        self.ms = 0.0  # drafting time per drafting step
        self.tokens = 1.0  # tokens per step
        self.tries = _Tries(config.explore, config.max_explore)  # while drafting does not pay

    def offer(self, cost: NodeCost, step: int) -> float | None:
        """What drafting at this step is expected to save, in ms (infinite on a try while it does not
        pay, so the try happens); None when it does not pay and no try is due."""
        saved = self.gain * cost.step_ms / self.tokens - self.ms
        if saved >= 0:
            self.tries.paid()
            return saved
        return float("inf") if self.tries.due(step) else None

    def observe(self, speculation: StepSpeculation, source: str, drafted_ms: float | None) -> None:
        """A step's yield; `source`: the drafter's name among the step's sources; `drafted_ms`: what it
        spent drafting the step (None: it did not draft)."""
        d = self.config.decay
        self.tokens = d * self.tokens + (1 - d) * speculation.accepted
        if drafted_ms is not None:
            self.gain = d * self.gain + (1 - d) * speculation.sources.get(source, 0)
            self.ms = d * self.ms + (1 - d) * drafted_ms


class AheadGate:
    """Whether a prepared tree goes to the server at once, as a step ahead of the one in flight.

    A step sent ahead and taken up saves the round trip the next step would start after the reply:
    the link and the client's verifying, less what preparing it took beyond the server's time on the
    step in flight. One dropped costs the server its compute, which delays the next step by what
    outlasts the link and the verifying; even when it delays nothing here, it is load other sessions
    on the server feel, so below `min_taken` taken up, steps do not go ahead. The share taken up is a
    running average over the steps sent ahead (`prior` before any); while sending does not pay, a
    step goes ahead anyway now and then, each try that finds it still not paying waiting twice as
    long for the next.
    """

    def __init__(
        self, prior: float = 0.3, decay: float = 0.8, explore: int = 8, max_explore: int = 64, min_taken: float = 0.1
    ) -> None:
        self.taken, self.decay, self.min_taken = prior, decay, min_taken
        self.tries = _Tries(explore, max_explore)  # while sending does not pay

    def offer(self, link_ms: float, verify_ms: float, prepare_ms: float, server_ms: float, step: int) -> bool:
        """Whether to send ahead at `step`: times of the link, the client's verifying after a reply, the
        preparing just done, and the server's step (the one in flight and the one ahead alike)."""
        saved = max(link_ms + verify_ms - max(prepare_ms - server_ms, 0.0), 0.0)
        lost = max(server_ms - link_ms - verify_ms, 0.0)
        if self.taken * saved >= (1 - self.taken) * lost and saved > 0 and self.taken >= self.min_taken:
            self.tries.paid()
            return True
        return self.tries.due(step)

    def observe(self, taken: bool) -> None:
        self.taken = self.decay * self.taken + (1 - self.decay) * taken


class DrafterGates:
    """Each drafter's two gates, by its name, and the steps they schedule their tries by. A decoder keeps
    them from one generation to the next, so a conversation's next turn starts from what its last turns
    learned rather than from the priors (a few steps sent ahead and dropped each turn, when they do not
    pay)."""

    def __init__(self, config: GateConfig = GateConfig()) -> None:
        self.config = config
        self.step = 0  # steps decoded so far, across generations
        self._draft: dict[str, DraftGate] = {}
        self._ahead: dict[str, AheadGate] = {}

    def draft(self, name: str) -> DraftGate:
        """Whether the drafter `name` grows this step's tree."""
        return self._draft.setdefault(name, DraftGate(self.config))

    def ahead(self, name: str) -> AheadGate:
        """Whether the drafter `name`'s prepared tree goes ahead of the step in flight."""
        return self._ahead.setdefault(name, AheadGate())
