"""How a node's logits become the next token: greedy, sampled, or a speculative candidate accepted.

Candidates from lookahead and lookup are deterministic given the context, so speculative sampling
reduces to one rule per tree node (Leviathan et al. 2023, with a point-mass draft): try the
candidate children in order, accept child x with probability p(x) under the target's processed
distribution, on rejection set p(x) = 0 and renormalize before the next sibling, and when none is
accepted sample from what is left. The emitted token is then distributed exactly as plain sampling
from p, whatever the candidates were, so speculation changes speed and never the output distribution.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from splitllm.decoding.grammar import Grammar, GrammarState


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings with transformers' meaning; `do_sample=False` is greedy (argmax after the
    repetition penalty and the grammar, the only settings that can change the argmax). `grammar`
    constrains the output (decoding/grammar.py): what it does not allow is never chosen."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    grammar: Grammar | None = None

    @property
    def seeded(self) -> bool:
        """A seeded sample repeats only if every step's tree does: nothing about the trees may follow the clock
        or what was asked before."""
        return self.do_sample and self.seed is not None

    def __post_init__(self) -> None:
        if self.do_sample and not self.temperature > 0:
            raise ValueError("temperature must be positive when sampling (use do_sample=False for greedy)")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 turns it off)")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must lie in (0, 1]")
        if not self.repetition_penalty > 0:
            raise ValueError("repetition_penalty must be positive")


GREEDY = SamplingParams()


class Sampler:
    """Chooses each emitted token of one generation, remembering them for the repetition penalty.

    `history` is every token the model has seen or emitted so far (prompt included), as in
    transformers, where the penalty covers the whole `input_ids`.
    """

    def __init__(self, params: SamplingParams = GREEDY, history: Sequence[int] = ()) -> None:
        self.params = params
        self.history = list(history)
        # leaves the random module's state alone
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator().manual_seed(seed)
        self.grammar: GrammarState | None = params.grammar.start() if params.grammar is not None else None
        self.processors = LogitsProcessorList()
        if params.repetition_penalty != 1.0:
            self.processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
        if params.do_sample:
            if params.temperature != 1.0:
                self.processors.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k:
                self.processors.append(TopKLogitsWarper(params.top_k))
            if params.top_p < 1.0:
                self.processors.append(TopPLogitsWarper(params.top_p))

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """This node's logits (vocab,) after the grammar and the processors, in float64, given the history."""
        scores = logits.to(torch.float64)[None]
        if self.grammar is not None:
            scores = scores.masked_fill(~self.grammar.allowed(scores.shape[-1]), float("-inf"))
        if self.processors:
            ids = torch.tensor([self.history], dtype=torch.long).reshape(1, -1)
            scores = self.processors(cast(torch.LongTensor, ids), scores)  # transformers types its ids so
        return scores[0]

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.scores(logits), dim=-1)

    def choose(self, logits: torch.Tensor, candidates: Sequence[int] = ()) -> int:
        """The token emitted at a node whose logits are given; when it is one of `candidates`, the
        caller descends into that child. Greedy takes the argmax; sampling applies the rule above."""
        if not self.params.do_sample:
            token = int(self.scores(logits).argmax())
        else:
            token = self._accept(self.probs(logits), candidates)
        self.history.append(token)
        if self.grammar is not None:
            self.grammar.advance(token)
        return token

    def allowed_prefix(self, tokens: Sequence[int]) -> int:
        """How many of a draft's `tokens`, after the history, the grammar allows (all without one)."""
        return len(tokens) if self.grammar is None else self.grammar.accepted(tokens)

    def _accept(self, p: torch.Tensor, candidates: Sequence[int]) -> int:
        for x in candidates:
            px = float(p[x])
            if px == 0:
                continue
            if float(torch.rand((), generator=self.generator, dtype=torch.float64)) < px:
                return int(x)
            p = p.clone()
            p[x] = 0.0
            p /= p.sum()
        return int(torch.multinomial(p, 1, generator=self.generator))
