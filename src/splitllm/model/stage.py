"""A contiguous range of decoder layers with its own KV cache: the unit each side runs."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from splitllm.kv import KVCache
from splitllm.model.blocks import DecoderLayer, Rotary
from splitllm.model.config import ModelConfig
from splitllm.model.weights import ModelFiles
from splitllm.visibility import Visibility

_LAYER_TENSORS = {
    "input_norm": ["input_layernorm.weight"],
    "qkv": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
    "qkv_bias": ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
    "o_proj": ["self_attn.o_proj.weight"],
    "post_norm": ["post_attention_layernorm.weight"],
    "gate_up": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "down": ["mlp.down_proj.weight"],
}


class Stage(nn.Module):
    """Layers [start, end) of a model; `forward` runs one step of n new positions over a cache.

    Weights are shared; each session brings its own cache (`new_cache`).
    """

    def __init__(self, cfg: ModelConfig, start: int, end: int, dtype: torch.dtype) -> None:
        super().__init__()
        if not 0 <= start < end <= cfg.num_layers:
            raise ValueError(f"layer range [{start}, {end}) is outside the model's {cfg.num_layers} layers")
        self.cfg, self.start, self.end, self.dtype = cfg, start, end, dtype
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(start, end))
        self.windows = cfg.layer_windows[start:end]
        self.rotary = Rotary(cfg)

    def new_cache(self, max_context: int) -> KVCache:
        cfg = self.cfg
        return KVCache(self.end - self.start, cfg.num_kv_heads, cfg.head_dim, max_context, self.dtype)

    @classmethod
    def load(cls, files: ModelFiles, start: int, end: int, dtype: torch.dtype) -> Stage:
        """Build the stage reading only its own layers' tensors."""
        stage = cls(files.config, start, end, dtype)
        for i, layer in zip(range(start, end), stage.layers):
            for attr, suffixes in _LAYER_TENSORS.items():
                if getattr(layer, attr) is None:
                    continue
                names = [f"model.layers.{i}.{s}" for s in suffixes]
                parts = files.read(names, dtype)
                getattr(layer, attr).data = torch.cat([parts[n] for n in names]).contiguous()
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

    @torch.inference_mode()
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
        self.check_step(cache, hidden, positions, vis, keep)
        cache.keep(keep)
        n = hidden.shape[0]
        cache.stage_new(positions)
        cos, sin = self.rotary(positions, self.dtype)
        cache_pos = cache.positions[: cache.length]
        masks = {w: vis.additive_mask(cache_pos, positions, w, self.dtype) for w in set(self.windows)}
        x = hidden.to(self.dtype)[None]
        for i, (layer, window) in enumerate(zip(self.layers, self.windows)):
            k, v, offset = cache.layer(i, n)
            x = layer(x, cos, sin, masks[window], k, v, offset)
        return x[0]
