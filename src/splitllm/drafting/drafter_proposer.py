"""The learned drafter's proposer: an EAGLE-style drafter grows the tree from the client's own top-layer features.

The drafter's cache mirrors the committed sequence: after every step the decoder hands over the true
features (last-stage output) of the positions it committed, and the next `propose` that drafts appends one
entry per such position t with input (f_t, embed(x_{t+1})). The last entry predicts the feature after
the bonus token, whose logits over the draft vocabulary give the tree's first level; a node's entry
takes its parent's predicted feature and its own token (scored_tree.py grows and scores the tree).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, cast

import torch
from torch import nn

from splitllm.decoding.sizing.calibration import CalibrationConfig
from splitllm.drafting.scored_tree import ScoredTreeProposer, chain_after
from splitllm.drafting.draft_model import DraftModel
from splitllm.drafting.drafter import Drafter


class DraftingClient(Protocol):
    """What the drafters draft with besides themselves: the client's embedding, final norm and LM head
    (the client's `ClientModel`), the drafter shipped or trained for the model and a draft model, if any."""

    dtype: torch.dtype

    @property
    def drafter(self) -> Drafter | None: ...

    @property
    def draft_model(self) -> DraftModel | None: ...

    def embed(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def normed(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def drafter_vocab_head(self) -> nn.Module:
        """The LM head's rows of the drafter's draft vocabulary, as a linear layer."""
        ...


class DrafterProposer(ScoredTreeProposer):
    """Scored trees from a learned `Drafter` over the target's features."""

    def __init__(
        self,
        drafter: Drafter,
        client_model: DraftingClient,
        max_context: int,
        top_k: int = 6,
        beam: int = 4,
        calibration_config: CalibrationConfig = CalibrationConfig(),
    ) -> None:
        super().__init__(drafter.new_cache(max_context + 32 * beam), top_k, beam, calibration_config)
        self.drafter, self.client_model, self.taps = drafter, client_model, drafter.taps
        self.vocab_head = client_model.drafter_vocab_head()
        # (first position, true features, taps) not in the cache yet
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []
        self.next_position: int | None = None  # position of the next committed entry

    @property
    def max_position(self) -> int:
        return self.drafter.cfg.max_position

    def observe(self, start: int, features: torch.Tensor, taps: torch.Tensor | None = None) -> None:
        if (taps is None) != (not self.drafter.taps):
            raise ValueError(f"this drafter reads the outputs of layers {list(self.drafter.taps)} beside the features")
        if self.next_position is None:
            self.next_position = start
        self.pending.append((start, features.detach(), None if taps is None else taps.detach()))

    def _sync(self, history: Sequence[int]) -> tuple[torch.Tensor, int] | None:
        """Append the committed entries not in the cache yet; the predicted feature after the last one."""
        if not self.pending or self.next_position is None:
            return None
        features = torch.cat([f for _, f, _ in self.pending])
        # A tapped drafter observes taps with every feature (`observe` checks).
        taps = torch.cat(cast("list[torch.Tensor]", [t for _, _, t in self.pending])) if self.drafter.taps else None
        first = self.pending[0][0]
        self.pending = []
        if first != self.next_position:
            raise ValueError(f"drafter fed position {first}, expected {self.next_position}")
        n = features.shape[0]
        positions = torch.arange(first, first + n)
        if first + n >= len(history):
            raise ValueError("every committed feature needs the token that followed it")
        self.cache.crop(self.committed)
        sees = chain_after(self.committed, n)
        embeddings = self.client_model.embed(torch.tensor(history[first + 1 : first + n + 1]))
        out = self.drafter.grow(self.cache, features, embeddings, positions, sees, taps)
        self.committed += n
        self.next_position = first + n
        return out[-1:], len(history) - 2

    def _expand(self, parents: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                sees: torch.Tensor) -> torch.Tensor:
        return self.drafter.grow(self.cache, parents, self.client_model.embed(tokens), positions, sees)

    def _top(self, outputs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        # the vocab head's dtype
        normed = self.client_model.normed(outputs.to(self.client_model.dtype)).to(self.drafter.dtype)
        rows = cast(int, self.vocab_head.out_features)
        q, idx = torch.softmax(self.vocab_head(normed).float(), dim=-1).topk(min(k, rows), dim=-1)
        return q, self.drafter.vocab[idx]
