"""An EAGLE-style drafter: one decoder layer that predicts the target's next top-layer feature.

Input at committed position t is [f_t, e(x_{t+1})]: the target's feature of token t (the output of the
last decoder layer, before the final norm) and the embedding of the token that followed it. `fc` combines
the pair into one hidden state, one decoder layer of the target's shape (with its own KV cache, masks
and rotary from `Stage`) turns it into a guess of f_{t+1}, and the target's own final norm and LM head,
restricted to a reduced draft vocabulary, turn that guess into the distribution of x_{t+2}.
Deeper guesses feed predicted features back in place of real ones. Only `fc` (and a tapped drafter's
`fuse`), the layer and the vocabulary are learned and shipped; the embedding, norm and LM head are
the client's.

A tapped drafter (EAGLE-3's low, middle and high features) also reads, at committed positions, the
outputs of other layers the client holds for free: its first K layers' and the middle state the server
returns (the input of layer N - M). Its `taps` name those layers; `fuse` projects the tap outputs, each
RMS-normalised (their scales differ by layer, with a few dimensions in the thousands), onto a
correction added to f_t. Deeper guesses have no taps and go in as they are. `fuse` starts at zero,
so a tapped drafter starts as the plain one, and stored in int8 its scales fit what it learned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from splitllm.model.kv import KVCache
from splitllm.model.config import ModelConfig
from splitllm.model.precision import Precision
from splitllm.model.stage import Stage, Step
from splitllm.model.visibility import Visibility


def drafter_config(target: ModelConfig, intermediate_size: int | None = None) -> ModelConfig:
    """The one-layer config of a drafter for `target`: same width, heads and rotary, full attention."""
    return replace(
        target,
        num_layers=1,
        layer_windows=(None,),
        layer_ropes=target.layer_ropes[-1:],
        intermediate_size=intermediate_size or target.intermediate_size,
    )


def check_taps(taps: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Taps as a tapped drafter and its capture take them: increasing layer counts inside the model."""
    if any(not isinstance(t, int) or not 0 < t < num_layers for t in taps) or list(taps) != sorted(set(taps)):
        raise ValueError(f"taps must be increasing layer counts between 1 and {num_layers - 1}, not {list(taps)}")
    return tuple(taps)


class Drafter(nn.Module):
    """fc([feature, next embedding]) -> one decoder layer -> predicted next feature.

    The learned drafter: one layer trained on the target's features, not a `DraftModel` (a whole smaller model).
    `vocab` holds the target token ids the drafter may propose (most frequent first); logits are over
    those ids only, in that order. `taps`: the layer counts whose outputs a tapped drafter reads beside
    the top feature (empty: the top feature alone).
    """

    vocab: torch.Tensor  # the buffer __init__ registers

    def __init__(
        self, cfg: ModelConfig, vocab: Sequence[int] | torch.Tensor, dtype: torch.dtype = torch.float32,
        taps: Sequence[int] = ()
    ) -> None:
        super().__init__()
        if cfg.num_layers != 1:
            raise ValueError("a drafter has exactly one decoder layer; build its config with drafter_config()")
        d = cfg.hidden_size
        self.cfg, self.dtype, self.taps = cfg, dtype, tuple(taps)
        self.quant = "none"  # how its weights run once `packed`
        # nn.Linear until `packed` swaps in the form the runtime drafts with.
        self.fuse: nn.Module | None = nn.Linear(len(self.taps) * d, d, bias=False, dtype=dtype) if self.taps else None
        self.fc: nn.Module = nn.Linear(2 * d, d, bias=True, dtype=dtype)
        self.stage = Stage(cfg, 0, 1, dtype)
        self.register_buffer("vocab", torch.as_tensor(vocab, dtype=torch.long), persistent=True)

    def packed(self, quant: str = "none") -> Drafter:
        """This drafter for drafting only: its linear weights in the form the CPU runs fastest (see
        `Precision.linear`), int8 with `quant="int8"` (a drafter stored in int8 loses nothing more, and a
        draft forward reads half the bytes); training and saving use the plain modules."""
        precision = Precision(self.dtype, quant)
        self.quant = quant
        layer = self.stage.layers[0]
        for name in ("qkv", "o_proj", "gate_up", "down"):
            linear = getattr(layer, name)
            setattr(layer, name, precision.linear(precision.store_linear(linear.weight.data), linear.bias))
        fc = cast(nn.Linear, self.fc)  # still the trained linears
        self.fc = precision.linear(precision.store_linear(fc.weight.data), fc.bias.data)
        if self.fuse is not None:
            self.fuse = precision.linear(precision.store_linear(cast(nn.Linear, self.fuse).weight.data), None)
        return self

    def new_cache(self, max_context: int) -> KVCache:
        return self.stage.new_cache(max_context)

    def combine(self, features: torch.Tensor, embeddings: torch.Tensor,
                taps: torch.Tensor | None = None) -> torch.Tensor:
        """(n, d) features and (n, d) next-token embeddings -> (n, d) inputs of the layer; `taps`
        (n, len(self.taps) d): the tapped layers' outputs at committed positions, fused with the features."""
        if taps is not None:
            if self.fuse is None or taps.shape != (features.shape[0], len(self.taps) * self.cfg.hidden_size):
                raise ValueError(
                    f"this drafter reads the outputs of layers {list(self.taps)}, not taps of shape {tuple(taps.shape)}"
                )
            d = self.cfg.hidden_size
            normed = F.rms_norm(taps.to(self.dtype).unflatten(-1, (len(self.taps), d)), (d,), eps=self.cfg.rms_norm_eps)
            features = features.to(self.dtype) + self.fuse(normed.flatten(-2))
        return self.fc(torch.cat([features.to(self.dtype), embeddings.to(self.dtype)], dim=-1))

    @torch.inference_mode()
    def forward(
        self,
        cache: KVCache,
        features: torch.Tensor,
        embeddings: torch.Tensor,
        positions: torch.Tensor,
        vis: Visibility,
        keep: Sequence[int],
        taps: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predicted next features (n, d) for n new entries, with the cache contract of `Stage.forward`."""
        return self.stage(cache, Step(self.combine(features, embeddings, taps), positions, vis, keep))

    @torch.inference_mode()
    def grow(
        self, cache: KVCache, features: torch.Tensor, embeddings: torch.Tensor, positions: torch.Tensor,
        sees: torch.Tensor,
        taps: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append n entries after everything in `cache` and return their predicted next features
        (`Stage.extend`: `sees` (n, length + n) says which entries each attends to)."""
        return self.stage.extend(cache, self.combine(features, embeddings, taps), positions, sees)
