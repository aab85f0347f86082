"""The step sent ahead of the one in flight: one object owns its life, from sent to taken up or dropped.

While a step is in flight, the drafter that grew its tree prepares the next step's tree after the path
the step likely accepts. Sent at once, that tree is a step of its own (`StepAhead`): its keep commits the
likely path, and its first level stands for the bonus token, so its tree hangs from the path's last node
(`SentStep.graft`). The server runs it right after the step in flight, while that step's reply travels
back. Verifying the step in flight then offers the graft's tokens at that node beside the tree's own:
if the model chooses one, the step sent ahead is TAKEN (it is the next step, its reply already on the
way); if not, it is DROPPED, and the next step crops the caches back to where its keep and the
outcome part (`SplitPipeline.drop_ahead`). Either way every committed token is the model's own choice,
asked for once, so outputs stay sequential's (greedy) and exactly distributed (sampling).

The scorer below holds what each layer must keep of such a step (the first stage's outputs, which
connection its reply comes on); only a `StepAhead`'s transitions move it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from enum import Enum

import torch

from splitllm.decoding.layout import SentStep, plan_step
from splitllm.decoding.proposers import TreeDrafter
from splitllm.decoding.scorer import SendingAhead
from splitllm.decoding.tree import ROOT, CandidateTree
from splitllm.decoding.verifier import Graft, Verdict
from splitllm.stats import StepTiming


class AheadState(Enum):
    SENT = "sent"  # on the wire behind the step in flight, whose verdict decides
    TAKEN = "taken"  # the model chose one of its first-level tokens: it is the next step
    DROPPED = "dropped"  # given up: the next step crops what it added


class StepAhead:
    """A step sent ahead of the step in flight (`sent`), its drafter, and where it stands (`state`)."""

    def __init__(self, sent: SentStep, drafter: TreeDrafter, scorer: SendingAhead) -> None:
        self.sent, self.drafter, self.scorer = sent, drafter, scorer
        self.state = AheadState.SENT

    @classmethod
    def send(cls, scorer: SendingAhead, flight: SentStep, path: list[int], reached: float, drafter: TreeDrafter,
             remaining: int) -> StepAhead | None:
        """Send `drafter`'s prepared tree as the step after `flight`, its keep the flight's chain and `path`
        (nodes of the flight's tree after its entry), its tree hung from the path's last node; None when
        the scorer cannot take one now or nothing is worth sending. Its first level offers only bonus
        tokens the flight's tree lacks there (the others go on in the flight's tree), and a node is worth
        sending only as likely as the flight accepts the path (`reached`) and the model then takes the
        node; it is no deeper than the `remaining` tokens to emit."""
        if not scorer.ahead_ready:
            return None
        kept = [flight.entry] if flight.entry != ROOT else []
        keep = (*range(len(flight.chain)), *(len(flight.chain) + i for i in [*kept, *path]))
        start = flight.start + len(keep)
        budget = replace(flight.budget, depth=min(flight.budget.depth + 1, remaining - len(path) - 1))
        room = scorer.room(start)
        graft = path[-1] if path else flight.entry
        there = set(flight.tree.child_tokens(graft))
        candidates = [replace(c, score=(c.score or 0.0) * reached) for c in drafter.send_prepared()
                      if c.tokens[0] not in there]
        tree = CandidateTree.build(candidates, min(budget.max_nodes, room), budget.depth, None, budget.cost)
        if not len(tree):
            drafter.drop_sent()
            return None
        plan = plan_step([], start, tree, None)
        timing = StepTiming()
        scorer.send_ahead(plan.step(keep), timing)
        return cls(SentStep(tree, None, plan, [], start, budget, flight.grew, timing, graft=graft), drafter, scorer)

    @property
    def graft(self) -> Graft:
        """What the step in flight's verifying offers at the node this step hangs from."""
        return Graft(self.sent.graft, tuple(self.sent.tree.child_tokens(ROOT)))

    def settle(self, verdict: Verdict, going_on: bool, history: Sequence[int]) -> None:
        """The step in flight's verdict is in: TAKEN if the model chose one of this step's first-level tokens
        and the generation goes on (`history` then ends with that token), else DROPPED."""
        assert self.state is AheadState.SENT
        if verdict.handoff and going_on:
            entry = self.sent.tree.child(ROOT, verdict.tokens[-1])
            assert entry is not None
            self.sent.entry = entry
            self.drafter.take_sent(history)
            self.state = AheadState.TAKEN
            return
        self.drop()

    def receive(self, while_waiting: Iterator[object]) -> torch.Tensor:
        """A TAKEN step's hidden states, timed into `sent.timing`; `while_waiting` runs meanwhile."""
        assert self.state is AheadState.TAKEN
        return self.scorer.receive_ahead(self.sent.timing, while_waiting)

    def drop(self) -> None:
        """Give it up (SENT, or TAKEN and not received: the generation stopped), so the caches end where the
        last verdict's path says."""
        assert self.state is not AheadState.DROPPED
        self.scorer.drop_ahead()
        self.drafter.drop_sent()
        self.state = AheadState.DROPPED
