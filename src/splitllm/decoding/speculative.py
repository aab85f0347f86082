"""Speculative greedy decoding over the split: verify many guesses per round trip, commit what the model confirms.

One step sends, in one `Scorer.forward` call (laid out by decoding/layout.py):
  chain  - committed tokens with no cache entry yet (the prompt at first, then the last step's bonus token),
           causal; its last token is the step's root;
  tree   - the candidate tree hanging off the root (every proposer's candidates, merged: decoding/proposing.py);
  window - lookahead's Jacobi window, also hanging off the root, invisible to the tree.
The verifier walks the tree with the model's argmax; the next step's `keep` commits the chain and the
accepted nodes, so every stage compacts its cache without an extra round trip.

While a step is in flight the client's core would idle: a draft model that drafted the step meanwhile
prepares the next step's tree for the step's likeliest outcome (`TreeDrafter.prepare`), which the next
step takes when the outcome came true, so its drafting leaves the critical path. With `send_ahead` that
tree goes to the server at once as a step of its own, which the step in flight's verdict takes up or
drops (decoding/ahead.py).
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Collection, Generator, Iterator, Sequence
from dataclasses import replace

import torch

from splitllm.decoding.ahead import AheadState, StepAhead
from splitllm.decoding.layout import SentStep, fit_window, plan_step, speculation_of
from splitllm.decoding.mode_names import Mode
from splitllm.decoding.proposers import TreeDrafter
from splitllm.decoding.proposers.lookahead import LookaheadWindow, WindowLayout
from splitllm.decoding.proposers.suffix import SuffixCache
from splitllm.decoding.proposing import Proposing
from splitllm.decoding.sampling import Sampler
from splitllm.decoding.scorer import Scorer
from splitllm.decoding.sequential import decode_sequential
from splitllm.decoding.sizing.budget import SpecBudget
from splitllm.decoding.sizing.gate import DrafterGates
from splitllm.decoding.sizing.policies import BudgetPolicy, StaticPolicy
from splitllm.decoding.speculation_config import SpeculationConfig
from splitllm.decoding.step import StepOutput
from splitllm.decoding.tree import ROOT, CandidateTree
from splitllm.decoding.verifier import Verdict, verify
from splitllm.drafting.tree_drafters import TreeDrafters
from splitllm.stats import StepStats, StepTiming

log = logging.getLogger(__name__)
# Where a part of the split runs PyTorch's kernels, whose rows round by their step's size (Stage.row_invariant).
_NOT_ROW_INVARIANT = (
    "a part of the split runs PyTorch's kernels (the float32 exact mode, float16, or no splitllm kernel variant "
    "on this CPU), whose rows round differently in a tree than alone"
)


class SpeculativeDecoder:
    """A decoder (see `DECODERS`) drafting and sizing its steps as its `SpeculationConfig` says.

    `policy` sizes the steps the drafter does not draft in, `drafter_policy` (None: no drafter) those it does.
    A draft model's proposer stays from one generation to the next (its cache holds the history so far),
    and so do the drafters' gates (what drafting and sending ahead yielded so far).
    """

    def __init__(self, config: SpeculationConfig = SpeculationConfig(), suffixes: SuffixCache | None = None) -> None:
        self.config = config
        self.suffixes = suffixes  # earlier requests' tokens to draft from, beside the context lookup (None: none)
        self.policy = config.policy if config.policy is not None else StaticPolicy(config.static_budget(False))
        self.drafter_policy = config.drafter_policy
        self.tree_drafters = TreeDrafters(config.tree.top_k, config.tree.beam, config.calibration)
        self.gates = DrafterGates(config.gate)
        if self.drafter_policy is None and config.drafting.ngrams is None:  # the mode needs the drafter
            self.drafter_policy = StaticPolicy(config.static_budget(True))

    def __call__(
        self,
        pipeline: Scorer,
        prompt: list[int],
        max_new_tokens: int,
        stop_ids: Collection[int],
        sampler: Sampler | None = None,
        keep: Sequence[int] = (),
    ) -> Generator[StepOutput, None, None]:
        """Same contract as `decode_sequential`: `prompt` is fed first, `keep` commits a previous path.

        The proposers read `sampler.history` (everything the model has seen and emitted so far, which
        the sampler extends with each emitted token), so a conversation's earlier turns feed lookups too.
        """
        sampler = sampler or Sampler(history=prompt)
        if not pipeline.row_invariant:
            if self.config.mode != Mode.AUTO:
                raise ValueError(
                    f"decode mode '{self.config.mode}' would not reproduce sequential decoding here: "
                    f"{_NOT_ROW_INVARIANT}; use --decode sequential or auto, or bfloat16 where splitllm's kernels run"
                )
            _say_auto_is_sequential()
            yield from decode_sequential(pipeline, prompt, max_new_tokens, frozenset(stop_ids), sampler, keep)
            return
        generation = _Generation(self, pipeline, prompt, max_new_tokens, stop_ids, sampler, keep)
        try:
            while not generation.done:
                yield generation.step()
        except GeneratorExit:  # the caller stopped between steps (a stop string): the caches end at the last path
            generation.give_up_ahead()
            raise


@functools.cache
def _say_auto_is_sequential() -> None:
    """Said once per process: `auto` keeps its promise of sequential decoding's output by not speculating."""
    log.warning("auto decodes sequentially here: %s, so speculation would not reproduce it bit for bit",
                _NOT_ROW_INVARIANT)




class _Generation:
    """One call of a `SpeculativeDecoder`, a step at a time: its place in the sequence (the chain to feed,
    the keep to commit, the tokens left), its step sizing, and the step sent ahead, if any (`ahead`)."""

    def __init__(
        self,
        decoder: SpeculativeDecoder,
        pipeline: Scorer,
        prompt: list[int],
        max_new_tokens: int,
        stop_ids: Collection[int],
        sampler: Sampler,
        keep: Sequence[int],
    ) -> None:
        self.pipeline, self.stop_ids, self.sampler, self.config = pipeline, stop_ids, sampler, decoder.config
        self.history = sampler.history
        drafts = decoder.drafter_policy is not None and decoder.config.drafting.drafter_ngrams is not None
        drafters = decoder.tree_drafters.for_generation(pipeline.client_model, pipeline.max_context) if drafts else []
        self.proposing = Proposing(decoder.config, drafters, decoder.gates, sampler, decoder.suffixes)
        self.policy = self._policy(decoder)
        self.chain, self.keep = list(prompt), list(keep)
        self.start = pipeline.committed + len(self.keep)
        self.steps: list[StepStats] = []
        self.sized: list[StepStats] = []  # the steps the policy sized (not those taken up from one sent ahead)
        self.remaining = max_new_tokens
        self.stopped = False
        # The link's share of a round trip, least seen: work in flight that outlasts it only ever adds.
        self.link_ms = float("inf")
        # The step sent ahead: SENT while the step in flight is, TAKEN between that step and the next.
        self.ahead: StepAhead | None = None

    @property
    def drafters(self) -> list[TreeDrafter]:
        return self.proposing.drafters

    @property
    def done(self) -> bool:
        return self.stopped or self.remaining <= 0

    def _policy(self, decoder: SpeculativeDecoder) -> BudgetPolicy:
        """Who sizes this generation's steps: the drafter's policy when it drafts, the decoder's otherwise."""
        if self.sampler.params.seeded:
            return StaticPolicy(decoder.config.static_budget(bool(self.drafters)))
        drafter_policy = decoder.drafter_policy if self.drafters else None
        return decoder.policy if drafter_policy is None else drafter_policy

    def step(self) -> StepOutput:
        """One round trip: size, propose, lay out, score, verify, learn, record (a step taken up from one
        sent ahead was sized, proposed and sent already; its reply is on the way)."""
        taken, self.ahead = self.ahead, None
        if taken is None:
            flight, hidden, timing = self._send()
        else:
            flight, timing = taken.sent, taken.sent.timing
            hidden = taken.receive(self._in_flight(flight, timing))
        ahead, self.ahead = self.ahead, None  # sent while this step was in flight
        prepared = ahead is not None or any(d.prepared is not None for d in self.drafters)
        adopted = flight.entry != ROOT or (flight.grew is not None and self.drafters[flight.grew].adopted)
        verdict = self._verify(flight, hidden, timing, ahead)
        keep = [*range(len(flight.chain)), *(len(flight.chain) + i for i in verdict.path)]
        if flight.layout is not None and self.proposing.window is not None:
            self._advance_window(self.proposing.window, hidden[flight.plan.window_rows], timing)
        speculation = speculation_of(flight, verdict, prepared, adopted, ahead is not None)
        if self.drafters:
            self.proposing.learn(self.pipeline, self.start, hidden[keep], keep, speculation, timing, flight.grew)
        stats = StepStats(timing, speculation)
        self._commit(verdict, stats, keep, sized=flight.entry == ROOT)
        if ahead is not None:
            self.proposing.gates.ahead(ahead.drafter.name).observe(verdict.handoff)
            ahead.settle(verdict, not self.done, self.history)
            self.ahead = ahead if ahead.state is AheadState.TAKEN else None
        return StepOutput(list(verdict.tokens), stats, keep)

    def _send(self) -> tuple[SentStep, torch.Tensor, StepTiming]:
        """Size, propose and lay out a step, and send it; its hidden states once back."""
        room = max(self.pipeline.room(self.start) - len(self.chain), 0)  # nodes the tree and window may take
        budget = self._budget(room)
        reading = self.proposing.reading_beside(self.chain)
        candidates, grew = self.proposing.propose(budget, reading)
        rates = [self.proposing.rates.rates(c) for c in candidates]
        tree = CandidateTree.build(candidates, min(budget.max_nodes, room), budget.depth, rates, budget.cost)
        layout = self._layout(budget, room - len(tree))
        plan = plan_step(self.chain, self.start, tree, layout)
        timing = StepTiming()
        flight = SentStep(tree, layout, plan, self.chain, self.start, budget, grew, timing)
        catching_up = self.proposing.catch_up(reading, timing)
        waiting = itertools.chain(catching_up, self._in_flight(flight, timing))
        hidden, timing = self.pipeline.forward(plan.step(self.keep), timing, waiting)
        for _ in catching_up:  # what the round trip did not hide (a next tree not prepared in time is drafted later)
            pass
        return flight, hidden, timing

    def give_up_ahead(self) -> None:
        """Drop a step sent ahead and not received, so the caches end where the last step's path says."""
        if self.ahead is not None:
            self.ahead.drop()
            self.ahead = None

    def _budget(self, room: int) -> SpecBudget:
        """The policy's budget, its candidates no deeper than the tokens left to emit and the room left."""
        budget = self.policy.choose(self.sized)
        return replace(budget, depth=min(budget.depth, self.remaining - 1, room))

    def _in_flight(self, flight: SentStep, timing: StepTiming) -> Iterator[None]:
        """One piece of work for the round trip: the drafter that grew the flight's tree prepares the next
        step's (if it can) after the path the flight likely accepts, and with `send_ahead` sends it at once
        as the next step (`self.ahead`) when its gate says that pays; timed into `overlap_ms`. The drafter
        keeps what it prepared for its next propose."""
        drafter = self.drafters[flight.grew] if flight.grew is not None else None
        if drafter is None or not self.pipeline.overlaps or not self.config.prepare or self.sampler.params.seeded:
            return
        likely, reached = drafter.likely_path(lambda tokens: flight.walk(tokens) is not None, flight.entry != ROOT)
        path = flight.walk(likely) or []
        tokens = [flight.tree.tokens[i] for i in path]
        if self.remaining - len(tokens) <= 3 or not self.steps:  # the generation ends with this step or the next
            return
        t0 = time.perf_counter()
        last = self.steps[-1].timing
        back = t0 + (self.link_ms + last.server_ms) / 1000  # when the step is expected back
        drafter.prepare([*self.history, *tokens], flight.budget, back)
        ms = (time.perf_counter() - t0) * 1000
        gates = self.proposing.gates
        if (
            self.config.send_ahead and drafter.prepared is not None and self.sampler.grammar is None
            and gates.ahead(drafter.name).offer(self.link_ms, last.last_ms, ms, last.server_ms, gates.step)
        ):
            self.ahead = StepAhead.send(self.pipeline, flight, path, reached, drafter, self.remaining)
        timing.overlap_ms += (time.perf_counter() - t0) * 1000
        yield

    def _layout(self, budget: SpecBudget, room: int) -> WindowLayout | None:
        """Lookahead's window for this step, shrunk to the room the tree left."""
        window = self.proposing.window
        if window is None or not budget.window or self.remaining <= 1:  # a last token has no future to guess
            return None
        fitted = fit_window(budget, room)
        return window.layout(self.history, fitted) if fitted.window else None

    def _verify(self, flight: SentStep, hidden: torch.Tensor, timing: StepTiming, ahead: StepAhead | None) -> Verdict:
        """Walk the flight's tree with the sampler's choice at each node, the step sent ahead (if any)
        offering its first level at its graft. Where the whole tree's logits cost about one row's
        (`Scorer.shared_logit_rows`), they come in one call, which reads the LM head once where asking
        along the way would read it once per emitted token; else only the nodes along the way are asked
        for. A row's logits are the same bits either way."""
        tree, c = flight.tree, len(flight.chain)

        def row(node: int) -> int:  # the root's row is the chain's last; a step sent ahead has none
            return c - 1 if node == ROOT else c + node

        shared = self.pipeline.shared_logit_rows
        if 0 < len(tree) < shared:  # the root's row (if any) and the nodes' in one call
            low = row(ROOT) if c else 0
            every = self.pipeline.logits(hidden[low : c + len(tree)], timing)

            def logits(node: int) -> torch.Tensor:
                return every[row(node) - low]
        else:
            asked: dict[int, torch.Tensor] = {}

            def logits(node: int) -> torch.Tensor:  # with the likeliest next rows, as long as they come free
                if node not in asked:
                    nodes = tree.likeliest_below(node, shared)
                    rows = torch.tensor([row(n) for n in nodes])
                    asked.update(zip(nodes, self.pipeline.logits(hidden[rows], timing)))
                return asked[node]

        def choose(node: int, children: list[int]) -> int:
            return self.sampler.choose(logits(node), children)

        graft = ahead.graft if ahead is not None else None
        return verify(tree, choose, self.remaining, self.stop_ids, flight.entry, graft)

    def _advance_window(self, window: LookaheadWindow, outputs: torch.Tensor, timing: StepTiming) -> None:
        """Move the Jacobi window on by the approximate LM head's guesses at its outputs."""
        guesses = self.pipeline.approx_logits(outputs, timing).argmax(-1).tolist()
        window.advance(self.chain[-1], guesses)

    def _commit(self, verdict: Verdict, stats: StepStats, keep: list[int], sized: bool) -> None:
        """Move past this step: its path is the next step's keep, its bonus token the next chain. A step
        taken up from one sent ahead (not `sized`) tells the policy nothing: the previous step sized its
        tree, and its round trip began before the previous one's ended."""
        self.steps.append(stats)
        self.proposing.gates.step += 1
        if sized:
            self.sized.append(stats)
            self.link_ms = min(self.link_ms, stats.timing.round_trip_ms - stats.timing.server_ms)
        self.stopped = verdict.stopped
        self.remaining -= len(verdict.tokens)
        self.start += len(keep)
        self.chain, self.keep = list(verdict.tokens[-1:]), keep
