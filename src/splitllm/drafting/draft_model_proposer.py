"""A draft model's proposer: a smaller model with the target's tokenizer grows the tree from tokens alone.

Its cache holds the committed history, one entry per token at the token's own position; `_sync` feeds
the tokens committed since it last drafted (the whole prompt first) in passes of at most `PREFILL_ROWS`,
and the last one's output gives the tree's first level. A node's entry is its own token. The target's
features are not needed, so `observe` takes none.

A conversation's decoder keeps its proposer from one turn to the next: a turn's history extends the
last one's, so only its new tokens go through the draft model, not the whole conversation again. A
history that differs from what the cache holds (another conversation, an answer cut at a stop string)
keeps the common prefix.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from splitllm.decoding.sizing.calibration import CalibrationConfig
from splitllm.drafting.scored_tree import ScoredTreeProposer, chain_after
from splitllm.drafting.draft_model import DraftModel

PREFILL_ROWS = 512  # history tokens fed in one pass at most (bounds a long prompt's masks and activations)


class DraftModelProposer(ScoredTreeProposer):
    """Scored trees from a `DraftModel`'s next-token distributions."""

    name = "draft-model"
    reads_tokens = True

    def __init__(
        self,
        model: DraftModel,
        max_context: int,
        top_k: int = 6,
        beam: int = 4,
        calibration_config: CalibrationConfig = CalibrationConfig(),
    ) -> None:
        super().__init__(model.new_cache(max_context + 32 * beam), top_k, beam, calibration_config)
        self.model = model
        self.tokens: list[int] = []  # the committed tokens in the cache, in order

    @property
    def max_position(self) -> int:
        return self.model.max_position

    def observe(self, start: int, features: torch.Tensor, taps: torch.Tensor | None = None) -> None:
        """Nothing to take: a draft model reads the committed tokens themselves."""

    def catch_up(self, history: Sequence[int]) -> Iterator[torch.Tensor]:
        """Read the committed `history` into the cache, the tokens it lacks (the last one at least) a
        pass of at most `PREFILL_ROWS` per `next`, yielding each pass's outputs: passes can run while a
        round trip is in flight, and the next tree feeds only what comes after. Nothing to read for an
        empty history or one the draft model does not reach."""
        if not history or len(history) >= self.max_position:
            return
        if self.committed >= len(history) or list(history[: self.committed]) != self.tokens:
            same = next((i for i, (a, b) in enumerate(zip(self.tokens, history)) if a != b),
                        min(len(self.tokens), len(history)))
            self.committed = min(same, len(history) - 1)  # the last token again at least: its output drafts
            del self.tokens[self.committed :]
        self.cache.crop(self.committed)
        while self.committed < len(history):
            first = self.committed
            n = min(len(history) - first, PREFILL_ROWS)
            tokens = torch.tensor(history[first : first + n])
            out = self.model.grow(self.cache, tokens, torch.arange(first, first + n), chain_after(first, n))
            self.cache.keep(range(n))
            self.committed += n
            self.tokens += history[first : first + n]
            yield out

    def _sync(self, history: Sequence[int]) -> tuple[torch.Tensor, int] | None:
        out = None
        for out in self.catch_up(history):  # noqa: B007 (drained: the last step is read after the loop)
            pass
        return None if out is None else (out[-1:], len(history) - 1)

    def _expand(self, parents: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                sees: torch.Tensor) -> torch.Tensor:
        return self.model.grow(self.cache, tokens, positions, sees)

    def _top(self, outputs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.probs(outputs).topk(k, dim=-1)
