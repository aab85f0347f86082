"""Speculative greedy decoding over the split: verify many guesses per round trip, commit what the model confirms.

One step sends, in one `Scorer.forward` call:
  chain  - committed tokens with no cache entry yet (the prompt at first, then the last step's bonus token),
           causal; its last token is the step's root;
  tree   - the candidate tree hanging off the root (every proposer's candidates, merged);
  window - lookahead's Jacobi window, also hanging off the root, invisible to the tree.
The verifier walks the tree with the model's argmax; the next step's `keep` commits the chain and the
accepted nodes, so every stage compacts its cache without an extra round trip.

While a step is in flight the client's core would idle: a draft model that drafted the step meanwhile
prepares the next step's tree for the step's likeliest outcome (`ScoredTreeProposer.prepare`), which
the next step takes when the outcome came true, so its drafting leaves the critical path.

With `send_ahead` that tree goes to the server at once, as a step of its own: its keep commits the
likeliest path, and its first level stands for the bonus token, so its tree hangs from the path's last
node (a `Graft`). The server runs it right after the step in flight, while that step's reply travels
back. Verifying the step in flight then offers the graft's tokens at that node beside the tree's own:
if the model chooses one, the step sent ahead is the next step, its reply already on the way; if not,
it is dropped, and the next step crops the caches back to where its keep and the outcome part
(`SplitPipeline.drop_ahead`). Either way every committed token is the model's own choice, asked for
once, so outputs stay sequential's (greedy) and exactly distributed (sampling).
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections import Counter
from collections.abc import Collection, Generator, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from splitllm.decoding.sizing.budget import SpecBudget
from splitllm.decoding.sizing.calibration import CandidateRates
from splitllm.decoding.speculation_config import SpeculationConfig
from splitllm.decoding.sizing.gate import DrafterGates
from splitllm.decoding.sizing.policies import BudgetPolicy, StaticPolicy
from splitllm.decoding.proposers import Candidate, Proposer
from splitllm.drafting.draft_model_proposer import DraftModelProposer
from splitllm.drafting.drafter_proposer import DrafterProposer
from splitllm.decoding.proposers.lookahead import LookaheadWindow, WindowLayout
from splitllm.decoding.proposers.lookup import ContextLookup
from splitllm.decoding.proposers.suffix import SuffixCache, SuffixLookup
from splitllm.drafting.scored_tree import ScoredTreeProposer
from splitllm.decoding.mode_names import Mode
from splitllm.decoding.sampling import Sampler
from splitllm.decoding.sequential import decode_sequential
from splitllm.decoding.scorer import Scorer
from splitllm.decoding.step import StepOutput
from splitllm.decoding.tree import ROOT, CandidateTree
from splitllm.decoding.verifier import Graft, Verdict, verify
from splitllm.stats import StepSpeculation, StepStats, StepTiming
from splitllm.model.stage import Step
from splitllm.model.visibility import Visibility

log = logging.getLogger(__name__)
# Where a part of the split runs PyTorch's kernels, whose rows round by their step's size (Stage.row_invariant).
_NOT_ROW_INVARIANT = (
    "a part of the split runs PyTorch's kernels (the float32 exact mode, float16, or no splitllm kernel variant "
    "on this CPU), whose rows round differently in a tree than alone"
)


@dataclass
class StepPlan:
    tokens: list[int]
    positions: list[int]
    vis: Visibility
    window_rows: list[int]


def plan_step(chain: Sequence[int], start: int, tree: CandidateTree, window: WindowLayout | None) -> StepPlan:
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


def fit_window(budget: SpecBudget, room: int) -> SpecBudget:
    """The budget with its lookahead window shrunk to at most `room` nodes (none if even 2 x 2 is too big)."""
    if budget.window_nodes <= room:
        return budget
    sizes = [(w, n) for w in range(budget.window, 1, -1) for n in range(budget.levels, 1, -1) if w * n - 1 <= room]
    w, n = max(sizes, key=lambda s: (s[0] * s[1], s[0]), default=(0, 0))
    return replace(budget, window=w, levels=n)


@dataclass
class _Flight:
    """A step sent: its tree and window, their layout after `chain` (the committed tokens it feeds) from
    absolute position `start`, the budget that sized it and the drafter that grew it (None: none).
    A step sent ahead hangs from `graft`, a node of the step before it, and feeds no chain; once taken
    up, `entry` is its first-level node the model chose (the walk starts there) and `timing` its record
    since it was sent."""

    tree: CandidateTree
    layout: WindowLayout | None
    plan: StepPlan
    chain: list[int]
    start: int
    budget: SpecBudget
    grew: int | None
    graft: int = ROOT
    entry: int = ROOT
    timing: StepTiming | None = None

    def walk(self, tokens: Sequence[int]) -> list[int] | None:
        """The tree's nodes along `tokens` from the walk's start (a taken-up step's tokens begin with its
        entry's), or None if the tree does not hold them."""
        node, nodes = self.entry, []
        if self.entry != ROOT:
            if tokens[:1] != [self.tree.tokens[self.entry]]:
                return None
            tokens = tokens[1:]
        for token in tokens:
            found = self.tree.child(node, token)
            if found is None:
                return None
            nodes.append(node := found)
        return nodes


def speculation_of(flight: _Flight, verdict: Verdict, prepared: bool, adopted: bool,
                   sent_ahead: bool) -> StepSpeculation:
    """What a step speculated and what of it the model confirmed; `prepared`: the next step's tree was
    prepared while it was in flight, `adopted`: its tree was the one prepared while the last step was,
    `sent_ahead`: the next step went to the server meanwhile. A step sent ahead and taken up leads its
    path with its entry node, whose token the step before emitted (so it counts there)."""
    tree, accepted = flight.tree, verdict.path[1:] if flight.entry != ROOT else verdict.path
    return StepSpeculation(
        accepted=len(verdict.tokens),
        drafted=len(tree),
        window=len(flight.layout.tokens) if flight.layout else 0,
        proposer=tree.sources[accepted[-1]][0] if accepted else "",
        sources=dict(Counter("+".join(sorted(tree.sources[i])) for i in accepted)),
        prepared=int(prepared),
        adopted=int(adopted),
        sent_ahead=int(sent_ahead),
        ran_ahead=int(flight.entry != ROOT),
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
        self.draft_model_proposer: DraftModelProposer | None = None
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


def _proposers(
    decoder: SpeculativeDecoder, pipeline: Scorer, sampler: Sampler
) -> tuple[list[Proposer], list[ScoredTreeProposer]]:
    """A generation's own proposers (they index its history): n-gram ones, and its drafters' when it
    drafts: a draft model's first (kept from the decoder's last generation), then the learned drafter's."""
    config, drafting = decoder.config, decoder.config.drafting
    client_model = pipeline.client_model
    drafters: list[ScoredTreeProposer] = []
    if decoder.drafter_policy is not None and drafting.drafter_ngrams is not None:
        if client_model.draft_model is not None:
            kept = decoder.draft_model_proposer
            if (
                kept is None or kept.model is not client_model.draft_model
                or kept.cache.max_context < pipeline.max_context
            ):
                kept = DraftModelProposer(client_model.draft_model, pipeline.max_context, config.tree.top_k,
                                          config.tree.beam, config.calibration)
                decoder.draft_model_proposer = kept
            drafters.append(kept)
        if client_model.drafter is not None:
            drafters.append(DrafterProposer(client_model.drafter, client_model, pipeline.max_context, config.tree.top_k,
                                            config.tree.beam, config.calibration))
    ngrams = drafting.drafter_ngrams if drafters else drafting.ngrams
    if ngrams is None:
        raise ValueError(
            f"decode mode '{config.mode}' needs a drafter for this model: train one with "
            "`splitllm drafter train --model <model> --out <folder>` and pass --drafter <folder>, or pass "
            "--draft-model <a smaller model with its tokenizer>"
        )
    proposers = config.proposers() if config.proposers else [make() for make in ngrams]
    # Earlier requests draft beside the context lookup, but not for a seeded sample (`SamplingParams.seeded`).
    if decoder.suffixes is not None and ContextLookup in ngrams and not sampler.params.seeded:
        proposers.append(SuffixLookup(decoder.suffixes))
    return proposers, drafters


class _Generation:
    """One call of a `SpeculativeDecoder`: its proposers, step sizing and place in the sequence, one step at a time."""

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
        self.proposers, self.drafters = _proposers(decoder, pipeline, sampler)
        self.window = next((p for p in self.proposers if isinstance(p, LookaheadWindow)), None)
        self.policy = self._policy(decoder)
        self.gates = decoder.gates
        self.rates = CandidateRates(decoder.config.calibration)
        self.chain, self.keep = list(prompt), list(keep)
        self.start = pipeline.committed + len(self.keep)
        self.steps: list[StepStats] = []
        self.sized: list[StepStats] = []  # the steps the policy sized (not those taken up from one sent ahead)
        self.remaining = max_new_tokens
        self.stopped = False
        # The link's share of a round trip, least seen: work in flight that outlasts it only ever adds.
        self.link_ms = float("inf")
        self.ahead: _Flight | None = None  # the step sent ahead of the one in flight
        self.taken: _Flight | None = None  # the step sent ahead that is the next step

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
        flight, self.taken = self.taken, None
        if flight is None:
            flight, hidden, timing = self._send()
        else:
            assert flight.timing is not None
            timing = flight.timing
            hidden = self.pipeline.receive_ahead(timing, self._in_flight(flight, timing))
        prepared = any(d.prepared is not None or d.sent is not None for d in self.drafters)
        adopted = flight.entry != ROOT or (flight.grew is not None and self.drafters[flight.grew].adopted)
        ahead, self.ahead = self.ahead, None
        verdict = self._verify(flight, hidden, timing, ahead)
        keep = [*range(len(flight.chain)), *(len(flight.chain) + i for i in verdict.path)]
        if flight.layout is not None and self.window is not None:
            self._advance_window(self.window, hidden[flight.plan.window_rows], timing)
        speculation = speculation_of(flight, verdict, prepared, adopted, ahead is not None)
        if self.drafters:
            self._feed_drafters(hidden[keep], keep, speculation, timing, flight.grew)
        stats = StepStats(timing, speculation)
        self._commit(verdict, stats, keep, sized=flight.entry == ROOT)
        if ahead is not None:
            self._settle(ahead, verdict)
        return StepOutput(list(verdict.tokens), stats, keep)

    def _send(self) -> tuple[_Flight, torch.Tensor, StepTiming]:
        """Size, propose and lay out a step, and send it; its hidden states once back."""
        room = max(self.pipeline.room(self.start) - len(self.chain), 0)  # nodes the tree and window may take
        budget = self._budget(room)
        reading = self._reading_beside()
        candidates, grew = self._propose(budget, reading)
        rates = [self.rates.rates(c) for c in candidates]
        tree = CandidateTree.build(candidates, min(budget.max_nodes, room), budget.depth, rates, budget.cost)
        layout = self._layout(budget, room - len(tree))
        plan = plan_step(self.chain, self.start, tree, layout)
        flight = _Flight(tree, layout, plan, self.chain, self.start, budget, grew)
        timing = StepTiming()
        catching_up = self._catch_up(reading, timing)
        waiting = itertools.chain(catching_up, self._in_flight(flight, timing))
        step = Step(torch.tensor(plan.tokens), torch.tensor(plan.positions), plan.vis, self.keep)
        hidden, timing = self.pipeline.forward(step, timing, waiting)
        for _ in catching_up:  # what the round trip did not hide (a next tree not prepared in time is drafted later)
            pass
        return flight, hidden, timing

    def _settle(self, ahead: _Flight, verdict: Verdict) -> None:
        """The step sent ahead is the next step if the model chose one of its first-level tokens and the
        generation goes on; else it is given up."""
        drafter = self.drafters[ahead.grew] if ahead.grew is not None else None
        if drafter is not None:
            self.gates.ahead(drafter.name).observe(verdict.handoff)
        if verdict.handoff and not self.done and drafter is not None:
            entry = ahead.tree.child(ROOT, verdict.tokens[-1])
            assert entry is not None
            ahead.entry = entry
            self.taken = ahead
            drafter.take_sent(self.history)
            return
        self.pipeline.drop_ahead()
        if drafter is not None:
            drafter.drop_sent()

    def give_up_ahead(self) -> None:
        """Drop what was sent ahead and not taken, so the caches end where the last step's path says."""
        for flight in (self.ahead, self.taken):
            if flight is not None:
                self.pipeline.drop_ahead()
                if flight.grew is not None:
                    self.drafters[flight.grew].drop_sent()
        self.ahead = self.taken = None

    def _budget(self, room: int) -> SpecBudget:
        """The policy's budget, its candidates no deeper than the tokens left to emit and the room left."""
        budget = self.policy.choose(self.sized)
        return replace(budget, depth=min(budget.depth, self.remaining - 1, room))

    def _reading_beside(self) -> list[DraftModelProposer]:
        """The draft models that read this step's chain beside its round trip instead of drafting it.

        A chain of more than one token is a prefill (the prompt, a conversation's new turn): the server
        reads those tokens through its layers, more and larger than a draft model's, so the draft model
        reads them meanwhile for free, where drafting would first read them on the client's critical
        path (a prompt of a few hundred tokens costs the 0.5B Qwen a large part of a second on one
        core). On other steps a draft model that does not draft catches up when it next drafts, in one
        pass: reading beside every round trip measured no faster. Both measurements:
        docs/results/drafting-log.md, "Reading a prefill beside its round trip"."""
        if len(self.chain) <= 1:
            return []
        return [d for d in self.drafters if isinstance(d, DraftModelProposer)]

    def _catch_up(self, reading: list[DraftModelProposer], timing: StepTiming) -> Iterator[None]:
        """The `reading` draft models' catch-up on the history, a pass per `next`, timed into `overlap_ms`."""
        for drafter in reading:
            t0 = time.perf_counter()
            for _ in drafter.catch_up(self.history):
                timing.overlap_ms += (time.perf_counter() - t0) * 1000
                yield
                t0 = time.perf_counter()

    def _in_flight(self, flight: _Flight, timing: StepTiming) -> Iterator[None]:
        """One piece of work for the round trip: the drafter that grew the flight's tree prepares the next
        step's (if it can) after the path the flight likely accepts, and with `send_ahead` sends it at once
        as the next step; timed into `overlap_ms`. The drafter keeps what it prepared (`prepared`) for its
        next propose, or what it sent (`sent`) until the step sent ahead is taken up or dropped."""
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
        if (
            self.config.send_ahead and drafter.prepared is not None and self.sampler.grammar is None
            and self.gates.ahead(drafter.name).offer(self.link_ms, last.last_ms, ms, last.server_ms, self.gates.step)
        ):
            self._send_ahead(flight, path, reached, drafter)
        timing.overlap_ms += (time.perf_counter() - t0) * 1000
        yield

    def _send_ahead(self, flight: _Flight, path: list[int], reached: float, drafter: ScoredTreeProposer) -> None:
        """Send the prepared tree as the step after `flight`, its keep the flight's chain and `path`
        (nodes of the flight's tree after its entry), its tree hung from the path's last node. Its
        first level offers only bonus tokens the flight's tree lacks there (the others go on in the
        flight's tree), and a node is worth sending only as likely as the flight accepts the path
        (`reached`) and the model then takes the node."""
        if not self.pipeline.ahead_ready:
            return
        kept = [flight.entry] if flight.entry != ROOT else []
        keep = (*range(len(flight.chain)), *(len(flight.chain) + i for i in [*kept, *path]))
        start = flight.start + len(keep)
        budget = replace(flight.budget, depth=min(flight.budget.depth + 1, self.remaining - len(path) - 1))
        room = self.pipeline.room(start)
        graft = path[-1] if path else flight.entry
        there = set(flight.tree.child_tokens(graft))
        candidates = [replace(c, score=(c.score or 0.0) * reached) for c in drafter.send_prepared()
                      if c.tokens[0] not in there]
        tree = CandidateTree.build(candidates, min(budget.max_nodes, room), budget.depth, None, budget.cost)
        if not len(tree):
            drafter.drop_sent()
            return
        plan = plan_step([], start, tree, None)
        timing = StepTiming()
        self.pipeline.send_ahead(Step(torch.tensor(plan.tokens), torch.tensor(plan.positions), plan.vis, keep), timing)
        self.ahead = _Flight(tree, None, plan, [], start, budget, flight.grew, graft=graft, timing=timing)

    def _propose(self, budget: SpecBudget, reading: list[DraftModelProposer]) -> tuple[list[Candidate], int | None]:
        """Every proposer's candidates, and which drafter grew a tree (None: none did).

        Without a link cost (a fixed budget) the first drafter not `reading` grows one every step; with
        one, the gates say which drafter's tree saves the most time, if any does. The others only learn
        from what was committed since they last drafted (an empty budget)."""
        self.rates.resolve(self.history)
        candidates = [d for p in self.proposers for d in p.propose(self.history, budget)]
        self.rates.track(candidates, len(self.history))
        if not self.drafters:
            return self._allowed(candidates), None
        free = [i for i, drafter in enumerate(self.drafters) if drafter not in reading]
        grows = free[0] if free else None
        if budget.cost is not None:
            gates = {i: self.gates.draft(self.drafters[i].name) for i in free}
            offers = {i: saved for i, gate in gates.items()
                      if (saved := gate.offer(budget.cost, self.gates.step)) is not None}
            grows = max(offers, key=offers.__getitem__) if offers else None
        for i, drafter in enumerate(self.drafters):
            candidates += drafter.propose(self.history, budget if i == grows else replace(budget, max_nodes=0))
        return self._allowed(candidates), grows

    def _allowed(self, candidates: list[Candidate]) -> list[Candidate]:
        """Under a grammar, each candidate cut where the grammar rejects it (no output changes: the verifier
        never accepts a token the grammar masks), so the tree's room goes to tokens that can be accepted.
        A scored candidate stands for its last node only, so one the grammar cuts is dropped."""
        if self.sampler.grammar is None:
            return candidates
        kept = []
        for candidate in candidates:
            n = self.sampler.allowed_prefix(candidate.tokens)
            if n == len(candidate.tokens):
                kept.append(candidate)
            elif n and candidate.score is None:
                kept.append(replace(candidate, tokens=candidate.tokens[:n]))
        return kept

    def _layout(self, budget: SpecBudget, room: int) -> WindowLayout | None:
        """Lookahead's window for this step, shrunk to the room the tree left."""
        if self.window is None or not budget.window or self.remaining <= 1:  # a last token has no future to guess
            return None
        fitted = fit_window(budget, room)
        return self.window.layout(self.history, fitted) if fitted.window else None

    def _verify(self, flight: _Flight, hidden: torch.Tensor, timing: StepTiming, ahead: _Flight | None) -> Verdict:
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

        graft = Graft(ahead.graft, tuple(ahead.tree.child_tokens(ROOT))) if ahead is not None else None
        return verify(tree, choose, self.remaining, self.stop_ids, flight.entry, graft)

    def _advance_window(self, window: LookaheadWindow, outputs: torch.Tensor, timing: StepTiming) -> None:
        """Move the Jacobi window on by the approximate LM head's guesses at its outputs."""
        guesses = self.pipeline.approx_logits(outputs, timing).argmax(-1).tolist()
        window.advance(self.chain[-1], guesses)

    def _feed_drafters(
        self,
        features: torch.Tensor,
        keep: list[int],
        speculation: StepSpeculation,
        timing: StepTiming,
        grew: int | None,
    ) -> None:
        """Hand every drafter the committed nodes' features (and a tapped drafter's taps), and each gate what
        the step yielded and what its drafter's drafting cost (timed into `draft_ms`); a step taken up from
        one sent ahead was drafted in flight, beside the gates' choice, so they learn nothing from it."""
        timing.draft_ms = 0.0
        for i, drafter in enumerate(self.drafters):
            taps = self.pipeline.tapped(drafter.taps)[keep] if drafter.taps else None
            drafter.observe(self.start, features, taps)
            ms = drafter.take_draft_ms()
            timing.draft_ms += ms
            if not speculation.ran_ahead:
                self.gates.draft(drafter.name).observe(speculation, drafter.name, ms if i == grew else None)

    def _commit(self, verdict: Verdict, stats: StepStats, keep: list[int], sized: bool) -> None:
        """Move past this step: its path is the next step's keep, its bonus token the next chain. A step
        taken up from one sent ahead (not `sized`) tells the policy nothing: the previous step sized its
        tree, and its round trip began before the previous one's ended."""
        self.steps.append(stats)
        self.gates.step += 1
        if sized:
            self.sized.append(stats)
            self.link_ms = min(self.link_ms, stats.timing.round_trip_ms - stats.timing.server_ms)
        self.stopped = verdict.stopped
        self.remaining -= len(verdict.tokens)
        self.start += len(keep)
        self.chain, self.keep = list(verdict.tokens[-1:]), keep
