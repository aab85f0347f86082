"""Where one generation's candidates come from: its n-gram proposers and its drafters, which drafter grows
each step's tree (the gates), and what they all learn once the model has chosen."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch

from splitllm.decoding.proposers import Candidate, Proposer, TreeDrafter
from splitllm.decoding.proposers.lookahead import LookaheadWindow
from splitllm.decoding.proposers.lookup import ContextLookup
from splitllm.decoding.proposers.suffix import SuffixCache, SuffixLookup
from splitllm.decoding.sampling import Sampler
from splitllm.decoding.scorer import Tapping
from splitllm.decoding.sizing.budget import SpecBudget
from splitllm.decoding.sizing.calibration import CandidateRates
from splitllm.decoding.sizing.gate import DrafterGates
from splitllm.decoding.speculation_config import SpeculationConfig
from splitllm.stats import StepSpeculation, StepTiming


class Proposing:
    """A generation's proposers (they index its history, `sampler.history`): the n-gram ones, with the
    `drafters` when it drafts (a draft model's first, then the learned drafter's); `window`: lookahead's,
    if among them. `gates` (kept by the decoder across generations) say which drafter grows a step's
    tree; `rates` learn how often each source's candidates come true."""

    def __init__(self, config: SpeculationConfig, drafters: list[TreeDrafter], gates: DrafterGates,
                 sampler: Sampler, suffixes: SuffixCache | None) -> None:
        self.drafters, self.gates, self.sampler = drafters, gates, sampler
        self.history = sampler.history
        self.rates = CandidateRates(config.calibration)
        drafting = config.drafting
        ngrams = drafting.drafter_ngrams if drafters else drafting.ngrams
        if ngrams is None:
            raise ValueError(
                f"decode mode '{config.mode}' needs a drafter for this model: train one with "
                "`splitllm drafter train --model <model> --out <folder>` and pass --drafter <folder>, or pass "
                "--draft-model <a smaller model with its tokenizer>"
            )
        self.proposers: list[Proposer] = config.proposers() if config.proposers else [make() for make in ngrams]
        # Earlier requests draft beside the context lookup, but not for a seeded sample (`SamplingParams.seeded`).
        if suffixes is not None and ContextLookup in ngrams and not sampler.params.seeded:
            self.proposers.append(SuffixLookup(suffixes))
        self.window = next((p for p in self.proposers if isinstance(p, LookaheadWindow)), None)

    def propose(self, budget: SpecBudget, reading: list[TreeDrafter]) -> tuple[list[Candidate], int | None]:
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

    def reading_beside(self, chain: Sequence[int]) -> list[TreeDrafter]:
        """The drafters that read a step's `chain` beside its round trip instead of drafting it.

        A chain of more than one token is a prefill (the prompt, a conversation's new turn): the server
        reads those tokens through its layers, more and larger than a draft model's, so a drafter that
        reads tokens alone reads them meanwhile for free, where drafting would first read them on the
        client's critical path (a prompt of a few hundred tokens costs the 0.5B Qwen a large part of a
        second on one core). On other steps a draft model that does not draft catches up when it next
        drafts, in one pass: reading beside every round trip measured no faster. Both measurements:
        docs/results/drafting-log.md, "Reading a prefill beside its round trip"."""
        if len(chain) <= 1:
            return []
        return [d for d in self.drafters if d.reads_tokens]

    def catch_up(self, reading: list[TreeDrafter], timing: StepTiming) -> Iterator[None]:
        """The `reading` drafters' catch-up on the history, a pass per `next`, timed into `overlap_ms`."""
        for drafter in reading:
            t0 = time.perf_counter()
            for _ in drafter.catch_up(self.history):
                timing.overlap_ms += (time.perf_counter() - t0) * 1000
                yield
                t0 = time.perf_counter()

    def learn(self, scorer: Tapping, start: int, features: torch.Tensor, keep: list[int],
              speculation: StepSpeculation, timing: StepTiming, grew: int | None) -> None:
        """Hand every drafter the committed nodes' features from position `start` (and a tapped drafter's
        taps), and each gate what the step yielded and what its drafter's drafting cost (timed into
        `draft_ms`); a step taken up from one sent ahead was drafted in flight, beside the gates' choice,
        so they learn nothing from it."""
        timing.draft_ms = 0.0
        for i, drafter in enumerate(self.drafters):
            taps = scorer.tapped(drafter.taps)[keep] if drafter.taps else None
            drafter.observe(start, features, taps)
            ms = drafter.take_draft_ms()
            timing.draft_ms += ms
            if not speculation.ran_ahead:
                self.gates.draft(drafter.name).observe(speculation, drafter.name, ms if i == grew else None)
