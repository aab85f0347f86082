"""Plain greedy decoding: one new token per round trip (the reference every other mode must match)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from splitllm.client.pipeline import SplitPipeline
from splitllm.decoding.step import StepOutput
from splitllm.visibility import Visibility


def decode_sequential(
    pipeline: SplitPipeline, prompt: list[int], max_new_tokens: int, stop_ids: frozenset[int]
) -> Iterator[StepOutput]:
    """Prefill the prompt in one step, then feed back each greedy token."""
    tokens, keep = prompt, []
    start = pipeline.committed + pipeline.pending
    produced = 0
    while produced < max_new_tokens:
        n = len(tokens)
        positions = torch.arange(start, start + n)
        logits, stats = pipeline.score(
            torch.tensor(tokens), positions, Visibility.chain(n), keep, rows=torch.tensor([n - 1])
        )
        token = int(logits[0].argmax())
        stats.accepted = 1
        produced += 1
        yield StepOutput([token], stats)
        if token in stop_ids:
            return
        keep, start, tokens = list(range(n)), start + n, [token]
