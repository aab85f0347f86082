"""Plain decoding: one new token per round trip (the reference every other mode must match)."""

from __future__ import annotations

from collections.abc import Generator, Sequence

import torch

from splitllm.decoding.sampling import Sampler
from splitllm.decoding.scorer import Scoring
from splitllm.decoding.step import StepOutput
from splitllm.model.stage import Step
from splitllm.model.visibility import Visibility
from splitllm.stats import StepSpeculation, StepStats


def decode_sequential(
    pipeline: Scoring,
    prompt: list[int],
    max_new_tokens: int,
    stop_ids: frozenset[int],
    sampler: Sampler | None = None,
    keep: Sequence[int] = (),
) -> Generator[StepOutput, None, None]:
    """Prefill the prompt in one step, then feed back each chosen token (greedy by default).

    `keep` commits the previous generation's path when this one continues it (a conversation).
    """
    sampler = sampler or Sampler()
    tokens, keep = prompt, list(keep)
    start = pipeline.committed + len(keep)
    produced = 0
    while produced < max_new_tokens:
        n = len(tokens)
        step = Step(torch.tensor(tokens), torch.arange(start, start + n), Visibility.chain(n), keep)
        logits, timing = pipeline.score(step, rows=torch.tensor([n - 1]))
        token = sampler.choose(logits[0])
        produced += 1
        yield StepOutput([token], StepStats(timing, StepSpeculation(accepted=1)), list(range(n)))
        if token in stop_ids:
            return
        keep, start, tokens = list(range(n)), start + n, [token]
