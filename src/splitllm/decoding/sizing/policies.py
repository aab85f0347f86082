"""Who decides a speculative step's budget: a `BudgetPolicy` answers one per step from the steps so far.

`StaticPolicy` always answers the same budget. `AdaptivePolicy` picks, each step, the candidate
budget with the most predicted tokens per second (auto_profile.py) and keeps three live estimates
from the steps it has seen, each an exponentially weighted average so it follows a link or a text
that changes:

- the link: network time against bytes on the wire (intercept = RTT, slope = 1 / bandwidth), after
  the profile's framing cost; the prefill, much bigger than a decode step, pins the slope;
- compute: how much slower or faster the client and the server run than the profile says, apart for
  a step's fixed part and for its rows (`_ComputeScale`): a bigger model or another precision changes
  the two differently, and the cost per row is what prices a tree;
- acceptance: how much more (or less) than the measured average the current text yields per step.

`ValuePolicy` sizes trees by value from the same estimates.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from splitllm.decoding.sizing.auto_profile import AutoProfile, BudgetYield
from splitllm.decoding.sizing.budget import AUTO_BUDGET, VALUE_BUDGET, NodeCost, SpecBudget
from splitllm.decoding.sizing.latency import Breakdown, LinearFit, Link, step_features
from splitllm.stats import StepStats


class BudgetPolicy(Protocol):
    def choose(self, steps: Sequence[StepStats]) -> SpecBudget:
        """The budget of the next step, given every step of this generation so far (prefill first)."""
        ...


@dataclass(frozen=True)
class StaticPolicy:
    budget: SpecBudget

    def choose(self, steps: Sequence[StepStats]) -> SpecBudget:
        return self.budget


class _Ratio:
    """Exponentially weighted ratio sum(w*y) / sum(w*x), shrunk toward `prior` by `weight` units of x.

    The prior does not fade but the evidence does, also on steps that bring none (`fade`): a policy
    that stopped speculating because drafts failed comes back to the prior and tries again.
    """

    def __init__(self, decay: float, prior: float = 1.0, weight: float = 2.0) -> None:
        self.decay, self.prior, self.weight = decay, prior, weight
        self.num = self.den = 0.0

    def update(self, y: float, x: float) -> None:
        self.num = self.decay * self.num + y
        self.den = self.decay * self.den + x

    def fade(self) -> None:
        self.update(0.0, 0.0)

    @property
    def value(self) -> float:
        return (self.prior * self.weight + self.num) / (self.weight + self.den)


def _context_after(steps: Sequence[StepStats]) -> int:
    """The context the next step is sized for: the last step's plus the tokens it emitted (0 before any step)."""
    return steps[-1].timing.context + steps[-1].speculation.accepted if steps else 0


ROW_FEATURES = ("nodes", "nodes*context", "accepted", "windowed")  # what grows with a step's rows


def split_rows(fit: LinearFit, x: dict[str, float]) -> tuple[float, float]:
    """A fitted compute time at features `x` as (fixed part, part that grows with the rows)."""
    fixed = fit({**x, **{f: 0.0 for f in ROW_FEATURES}})
    return fixed, fit(x) - fixed


class _ComputeScale:
    """measured ms ~= f * fixed + r * rows, where fixed and rows are the profile's two parts of a step.

    A discounted least-squares fit in milliseconds, so a big step (the prefill's tens of rows, a large
    tree) says more about the rows than a one-row step does, which pins the fixed part. It is shrunk
    toward the profile's (1, 1) in proportion to the evidence on each part (ridge on the Gram diagonal):
    steps all of one size cannot tell the parts apart, and then both keep the ratio the data shows.
    """

    def __init__(self, decay: float, shrink: float = 0.1) -> None:
        self.decay, self.shrink = decay, shrink
        self.a = np.zeros((2, 2))
        self.b = np.zeros(2)
        self._scales: tuple[float, float] | None = None  # solved once per update: a step asks for it many times

    def update(self, measured: float, fixed: float, rows: float) -> None:
        if measured <= 0 or fixed + rows <= 0:
            return
        x = np.array([fixed, rows])
        self.a = self.decay * self.a + np.outer(x, x)
        self.b = self.decay * self.b + x * measured
        self._scales = None

    @property
    def scales(self) -> tuple[float, float]:
        if self._scales is None:
            self._scales = self._solve()
        return self._scales

    def _solve(self) -> tuple[float, float]:
        if not self.a.any():
            return 1.0, 1.0
        prior = self.shrink * np.diag(np.diag(self.a)) + 1e-9 * np.eye(2)
        f, r = np.linalg.solve(self.a + prior, self.b + prior @ np.ones(2))
        return max(float(f), 0.05), max(float(r), 0.05)

    def __call__(self, fixed: float, rows: float) -> float:
        f, r = self.scales
        return f * fixed + r * rows


class _LinkEstimate:
    """network ms = rtt + bytes * ms_per_byte, on two time scales.

    The slope (1 / bandwidth) comes from a slowly discounted least-squares fit, held near 0 a priori
    by one pseudo-observation `lever` bytes away: decode steps of one size alone say nothing about
    bandwidth, while a prefill tens of kilobytes bigger does, and should be remembered. The RTT is
    a fast weighted average of what the slope leaves, so it follows a changing link within steps.
    """

    def __init__(self, decay: float, slow_decay: float, lever: float = 5_000.0) -> None:
        self.decay, self.slow_decay = decay, slow_decay
        self.a = np.zeros((2, 2))
        self.b = np.zeros(2)
        self.prior = np.diag([1e-6, lever**2])
        self.rtt = _Ratio(decay, prior=0.0, weight=1e-9)  # a weighted mean: sum(w*y) / sum(w*1)
        self._per_byte: float | None = None  # solved once per update

    def update(self, nbytes: float, network_ms: float) -> None:
        x = np.array([1.0, nbytes])
        self.a = self.slow_decay * self.a + np.outer(x, x)
        self.b = self.slow_decay * self.b + x * network_ms
        self._per_byte = None
        self.rtt.update(network_ms - self.per_byte * nbytes, 1.0)

    @property
    def per_byte(self) -> float:
        if self._per_byte is None:
            self._per_byte = max(float(np.linalg.solve(self.a + self.prior, self.b)[1]), 0.0)
        return self._per_byte

    def link(self) -> Link:
        rtt, per_byte = max(self.rtt.value, 0.0), self.per_byte
        return Link(rtt, 8 / (per_byte * 1e3) if per_byte > 1e-9 else None)


class _Estimates:
    """What one generation has learned so far (a new one starts from a copy of the latest)."""

    def __init__(self, halflife_steps: float) -> None:
        decay = 0.5 ** (1 / halflife_steps)
        slow = 0.5 ** (1 / (8 * halflife_steps))
        self.link = _LinkEstimate(decay, slow)
        self.client = _ComputeScale(slow)
        self.server = _ComputeScale(slow)
        self.gain = _Ratio(0.5 ** (1 / (4 * halflife_steps)), weight=4.0)  # one step says little: remember long
        self.chosen: list[BudgetYield | None] = []  # chosen[i] sized step i (None: the offline budget did)
        self.seen = 0
        self.networked = False  # has any step crossed a network?

    def fork(self) -> _Estimates:
        """Estimates for a new generation: what was learned carries over; whether its own steps cross
        a network, it learns from them (an in-process generation keeps the offline budget)."""
        new = copy.deepcopy(self)
        new.chosen, new.seen, new.networked = [], 0, False
        return new


class AdaptivePolicy:
    """A `BudgetPolicy` maximizing predicted tokens per second each step from live link, compute and
    acceptance estimates.

    Until a step has crossed a network (the very first step, or a middle run in-process for tests and
    offline measurements) there is no link to size for, and it answers the static `offline` budget.
    One instance belongs to one conversation: its generations run one after another, each (a new
    `steps` list) with its own estimates started from those of the previous one, so what one learned
    about the link carries over to the next.
    """

    def __init__(
        self,
        profile: AutoProfile | None = None,
        halflife_steps: float = 6.0,
        offline: SpecBudget = AUTO_BUDGET,
    ) -> None:
        self.profile = profile or AutoProfile.load()
        self._framing_intercept = self.profile.latency.framing.as_dict().get("1", 0.0)
        self.offline = offline
        if not self.profile.candidates:
            raise ValueError("an adaptive policy needs at least one candidate budget")
        self._latest = _Estimates(halflife_steps)
        self._steps: Sequence[StepStats] | None = None  # the current generation's steps
        self._lock = threading.Lock()

    def choose(self, steps: Sequence[StepStats]) -> SpecBudget:
        with self._lock:
            est = self._estimates(steps)
            self._observe(est, steps)
            if not est.networked:
                est.chosen.append(None)
                return self.offline
            context = _context_after(steps)
            link = est.link.link()
            best = max(self.profile.candidates, key=lambda c: self._predict(est, link, c, context).tokens_per_second)
            est.chosen.append(best)
            return best.budget

    @property
    def link(self) -> Link:
        """The link as the latest generation estimates it (RTT, and bandwidth when a cap shows)."""
        with self._lock:
            return self._latest.link.link()

    def predict(self, candidate: BudgetYield, context: float) -> Breakdown:
        """The next step's predicted time with this candidate, from the latest generation's estimates."""
        with self._lock:
            return self._predict(self._latest, self._latest.link.link(), candidate, context)

    def _predict(self, est: _Estimates, link: Link, candidate: BudgetYield, context: float) -> Breakdown:
        shape = candidate.shape(context, est.gain.value)
        latency = self.profile.latency
        p = latency.predict(shape, link, self.profile.decoder)
        x = shape.features()
        local, server = est.client(*split_rows(latency.local, x)), est.server(*split_rows(latency.server, x))
        c = local / p.local if p.local > 0 else 1.0  # the client's own bookkeeping scales with its compute
        framing = p.framing - self._framing_intercept  # already inside the live RTT
        return Breakdown(local, server, p.overhead * c, p.decode * c, p.rtt, p.transfer, framing, p.accepted)

    def _estimates(self, steps: Sequence[StepStats]) -> _Estimates:
        if steps is not self._steps:  # a new generation starts from what the last one learned
            self._steps, self._latest = steps, self._latest.fork()
        return self._latest

    def _observe(self, est: _Estimates, steps: Sequence[StepStats]) -> None:
        """Learn from the steps not seen yet."""
        latency = self.profile.latency
        for i in range(est.seen, len(steps)):
            s, t = steps[i], steps[i].timing
            x = step_features(s)
            # Over a network (in-process steps have none); a step sent ahead waited only for the rest of its trip.
            if t.round_trip_ms > t.server_ms and not s.speculation.ran_ahead:
                est.networked = True
                # The framing intercept fitted offline cannot be told apart from RTT live (it moves with
                # load), so the live RTT absorbs it and only the per-byte part is taken off.
                est.link.update(x["bytes"], t.network_ms - (latency.framing(x) - self._framing_intercept))
            est.server.update(t.server_ms, *split_rows(latency.server, x))
            est.client.update(t.first_ms + t.last_ms, *split_rows(latency.local, x))
            if i == 0 or i >= len(est.chosen):
                continue  # the prefill sized no tree: it says nothing about acceptance
            chosen = est.chosen[i]
            expected = chosen.accepted - 1 if chosen else 0.0
            if expected > 0:
                est.gain.update(s.speculation.accepted - 1, expected)
            else:
                est.gain.fade()
        est.seen = len(steps)


class ValuePolicy:
    """A `BudgetPolicy` for trees sized by value: a generous budget whose `NodeCost` comes from the
    adaptive policy's live link and compute estimates, so the tree keeps exactly the nodes whose
    estimated acceptance chance pays for their verification on the link measured so far.

    The node cost is the slope of the predicted step time between two tree sizes, and the step
    cost the same line at no tree (a multi-row step, so the cheaper one-row kernel does not skew it).
    """

    def __init__(self, adaptive: AdaptivePolicy | None = None, budget: SpecBudget = VALUE_BUDGET) -> None:
        self.adaptive = adaptive or AdaptivePolicy()
        self.budget = budget

    def choose(self, steps: Sequence[StepStats]) -> SpecBudget:
        self.adaptive.choose(steps)  # learn from the new steps
        return replace(self.budget, cost=self.cost(_context_after(steps)))

    def cost(self, context: float) -> NodeCost:
        small, large = 8, 32
        ms = [self.adaptive.predict(BudgetYield(self.budget, 1 + n, 1.0), context).total for n in (small, large)]
        node_ms = max((ms[1] - ms[0]) / (large - small), 1e-3)
        return NodeCost(max(ms[0] - small * node_ms, 0.0), node_ms)
