"""Everything one speculative decoder is set up with.

A speculative mode (`mode_names.Mode`, the names the CLI and the API take) is a `Drafting`: which proposers
draft its steps, with and without the drafter, and the static budget that sizes them. A
`SpeculationConfig` picks a mode and says who sizes the steps, how the drafter's drafting is gated and
how drafts' acceptance rates are learned.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from splitllm.decoding.mode_names import Mode
from splitllm.decoding.sizing.budget import AUTO_BUDGET, DRAFTER_BUDGET, LOOKAHEAD_BUDGET, LOOKUP_BUDGET, SpecBudget
from splitllm.decoding.sizing.calibration import CalibrationConfig
from splitllm.decoding.sizing.gate import GateConfig
from splitllm.decoding.sizing.policies import BudgetPolicy
from splitllm.decoding.proposers import Proposer
from splitllm.decoding.proposers.lookahead import LookaheadWindow
from splitllm.decoding.proposers.lookup import ContextLookup

ProposerFactory = Callable[[], Proposer]


@dataclass(frozen=True)
class Drafting:
    """How a speculative mode drafts.

    budget: the static budget of its steps.
    ngrams: the n-gram proposers of steps the drafter does not draft in; None: every step needs the drafter.
    drafter_ngrams: the n-gram proposers beside the drafter, when the decoder drafts with one; None: it never does.
    """

    budget: SpecBudget
    ngrams: tuple[ProposerFactory, ...] | None
    drafter_ngrams: tuple[ProposerFactory, ...] | None = None


SPECULATIVE_MODES: Mapping[Mode, Drafting] = MappingProxyType({
    Mode.LOOKAHEAD: Drafting(LOOKAHEAD_BUDGET, (LookaheadWindow,)),
    Mode.LOOKUP: Drafting(LOOKUP_BUDGET, (ContextLookup,)),
    Mode.DRAFTER: Drafting(DRAFTER_BUDGET, None, (ContextLookup,)),
    Mode.AUTO: Drafting(AUTO_BUDGET, (ContextLookup, LookaheadWindow), (ContextLookup,)),
})


@dataclass(frozen=True)
class TreeShape:
    """How wide a drafter's scored tree grows: each depth runs the `beam` best frontier nodes, and each
    offers its `top_k` likeliest tokens. Wider trees find more accepted tokens in more nodes, which the
    server pays for in rows (docs/results/drafting-log.md measures both)."""

    top_k: int = 6
    beam: int = 4

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.beam < 1:
            raise ValueError(f"a tree needs top_k and beam of at least 1, not {self.top_k} and {self.beam}")


@dataclass(frozen=True)
class SpeculationConfig:
    """One speculative decoder's setup.

    mode: which proposers draft (`SPECULATIVE_MODES`).
    policy: sizes the steps the drafter does not draft in; None: `budget`, statically.
    drafter_policy: sizes the steps it drafts in; None: `drafter_budget`, statically, in a mode that needs the
        drafter, and no drafter in the others (`auto` drafts with the drafter only given a drafter policy, so the
        budget sweep's fixed budgets keep to n-gram sources).
    budget, drafter_budget: the static budgets of those steps (budget None: the mode's); a seeded sampled
        generation always takes them, since it repeats only if every step's tree does.
    proposers: replaces the mode's n-gram proposers; a `LookaheadWindow` among them gets its Jacobi
        window into every step.
    gate: when growing the drafter's tree pays for the time it takes.
    calibration: how drafts' acceptance rates are learned.
    tree: how wide the drafters' trees grow (the budgets bound their nodes and depth).
    prepare: whether a draft model drafts the next step's tree while a step is in flight (speculative.py).
    send_ahead: whether that prepared tree goes to the server at once, as the next step built on the step in
        flight's likeliest outcome, so two steps are on the wire (ahead.py).
    """

    mode: Mode = Mode.AUTO
    policy: BudgetPolicy | None = None
    drafter_policy: BudgetPolicy | None = None
    budget: SpecBudget | None = None
    drafter_budget: SpecBudget = DRAFTER_BUDGET
    proposers: Callable[[], list[Proposer]] | None = None
    gate: GateConfig = GateConfig()
    calibration: CalibrationConfig = CalibrationConfig()
    tree: TreeShape = TreeShape()
    prepare: bool = True
    send_ahead: bool = True

    def __post_init__(self) -> None:
        if self.mode not in SPECULATIVE_MODES:
            raise ValueError(f"unknown speculative mode '{self.mode}'; choose from {', '.join(SPECULATIVE_MODES)}")

    @property
    def drafting(self) -> Drafting:
        return SPECULATIVE_MODES[self.mode]

    def static_budget(self, with_drafter: bool) -> SpecBudget:
        """The static budget of steps the drafter drafts in (`with_drafter`) or not."""
        if with_drafter:
            return self.drafter_budget
        return self.drafting.budget if self.budget is None else self.budget
