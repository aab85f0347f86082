"""A contiguous range of decoder layers with its own KV cache: the unit each side runs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from splitllm.kv import KVCache
from splitllm.model.blocks import DecoderLayer, Rotary, Segment
from splitllm.model.config import ModelConfig
from splitllm.model.precision import Precision
from splitllm.model.store import StoredWeights
from splitllm.model.weights import ModelFiles
from splitllm.visibility import Visibility

# Each layer attribute and the checkpoint tensors it is made of (fused along the outputs).
_NORMS = {"input_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight"}
_LINEARS = {
    "qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    "o_proj": ["self_attn.o_proj"],
    "gate_up": ["mlp.gate_proj", "mlp.up_proj"],
    "down": ["mlp.down_proj"],
}


@dataclass(frozen=True)
class StepInput:
    """One sequence's step: its cache, hidden states, positions, visibility and what to keep."""

    cache: KVCache
    hidden: torch.Tensor
    positions: torch.Tensor
    vis: Visibility
    keep: Sequence[int]


class Stage(nn.Module):
    """Layers [start, end) of a model; `forward` runs one step of n new positions over a cache.

    Weights are shared; each session brings its own cache (`new_cache`). `precision` (or a bare
    dtype: dense weights on the CPU) fixes how the stage stores and computes, once.
    """

    def __init__(self, cfg: ModelConfig, start: int, end: int, precision: Precision | torch.dtype) -> None:
        super().__init__()
        if not 0 <= start < end <= cfg.num_layers:
            raise ValueError(f"layer range [{start}, {end}) is outside the model's {cfg.num_layers} layers")
        self.precision = Precision.of(precision)
        self.cfg, self.start, self.end, self.dtype = cfg, start, end, self.precision.dtype
        self.device = self.precision.torch_device
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.precision) for _ in range(start, end))
        self.windows = cfg.layer_windows[start:end]
        self.rotary = Rotary(cfg)

    def new_cache(self, max_context: int) -> KVCache:
        cfg = self.cfg
        # Kept in the attention's dtype, so a step converts only its new entries, never the whole cache.
        at = self.precision.attention_dtype
        return KVCache(self.end - self.start, cfg.num_kv_heads, cfg.head_dim, max_context, at, self.device)

    @classmethod
    def load(cls, files: ModelFiles, start: int, end: int, precision: Precision | torch.dtype) -> Stage:
        """Build the stage reading only its own layers' tensors, in the form `precision` stores them."""
        stage = cls(files.config, start, end, precision)
        weights = StoredWeights(files, stage.precision)
        for i, layer in zip(range(start, end), stage.layers):
            prefix = f"model.layers.{i}."
            for attr, name in _NORMS.items():
                getattr(layer, attr).data = stage.precision.dense(weights.dense([prefix + name])[prefix + name])
            for attr, modules in _LINEARS.items():
                biases = [f"{prefix}{m}.bias" for m in modules]
                bias = biases if attr == "qkv" and files.config.qkv_bias else None
                setattr(layer, attr, weights.linear([f"{prefix}{m}.weight" for m in modules], bias))
        return stage

    def check_step(
        self, cache: KVCache, hidden: torch.Tensor, positions: torch.Tensor, vis: Visibility, keep: Sequence[int]
    ) -> None:
        """Validate a step before anything is mutated, so a bad request leaves the cache untouched."""
        n = positions.numel()
        if hidden.shape != (n, self.cfg.hidden_size) or positions.shape != (n,) or vis.n != n:
            raise ValueError(
                f"a step of {n} positions needs hidden states of shape ({n}, {self.cfg.hidden_size}) and an "
                f"{n} x {n} visibility, got {tuple(hidden.shape)} and {vis.n} x {vis.n}"
            )
        cache.check_keep(keep)
        if cache.length + len(keep) + n > cache.max_context:
            raise ValueError(
                f"step of {n} positions over a context of {cache.length + len(keep)} exceeds the "
                f"maximum context of {cache.max_context}"
            )
        if n and (int(positions.min()) < 0 or int(positions.max()) >= self.cfg.max_position):
            raise ValueError(f"positions must lie in [0, {self.cfg.max_position})")

    def forward(
        self,
        cache: KVCache,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        vis: Visibility,
        keep: Sequence[int],
    ) -> torch.Tensor:
        """hidden: (n, d) states entering layer `start`; returns (n, d) states leaving layer `end - 1`.

        `keep` first commits the chosen entries of the previous step, then the n new positions are
        appended as this step's pending entries.
        """
        return self.forward_many([StepInput(cache, hidden, positions, vis, keep)])[0]

    @torch.inference_mode()
    def forward_many(self, steps: Sequence[StepInput]) -> list[torch.Tensor]:
        """One step for each of several independent sequences (distinct caches) in one pass.

        The rows of all steps share every weight read; each attends only to its own cache and
        visibility. Every step is validated before any cache is touched.
        """
        if len({id(s.cache) for s in steps}) != len(steps):
            raise ValueError("a batch holds at most one step per cache")
        for s in steps:
            self.check_step(s.cache, s.hidden, s.positions, s.vis, s.keep)
        segments: dict[int | None, list[Segment]] = {w: [] for w in set(self.windows)}
        row = 0
        for s in steps:
            n = s.hidden.shape[0]
            s.cache.keep(s.keep)
            s.cache.stage_new(s.positions)
            cos, sin = (t.to(self.device) for t in self.rotary(s.positions, self.dtype))
            cache_pos = s.cache.positions[: s.cache.length]
            for w, segs in segments.items():
                mask = s.vis.additive_mask(cache_pos, s.positions, w, self.precision.attention_dtype)
                mask = None if mask is None else mask.to(self.device)
                segs.append(Segment(slice(row, row + n), cos, sin, mask, s.cache.length))
            row += n
        x = torch.cat([s.hidden.to(self.device, self.dtype) for s in steps])[None]
        for i, (layer, window) in enumerate(zip(self.layers, self.windows)):
            kv = [s.cache.layer(i, s.hidden.shape[0])[:2] for s in steps]
            x = layer(x, segments[window], kv)
        return list(x[0].split([s.hidden.shape[0] for s in steps]))
