"""A stage's whole step in one call to splitllm's CPU kernels (`kernels/csrc/decoder.cpp`).

Layer by layer, a one-position bfloat16 step makes ~40 PyTorch calls per layer around the weight
reads; with the weights streamed at the memory bandwidth those calls cost more than the reads. A
kernel stage runs the same layers (the same packed weights, the same attention kernel) with everything
in between as plain loops, and gives each row the same bits whatever else is in the step, so
speculation stays exact. It runs where every linear of the stage is a `BlockedLinear` and attention is
the kernel's, i.e. bfloat16 compute with bfloat16, int8 or int4 weights where a kernel variant runs; the
rounding differs slightly from the layer-by-layer path, so a stage always takes the same one.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch
from torch import nn

from splitllm.model.kv import KVCache
from splitllm.model.attention import KernelAttention
from splitllm.model.blocks import DecoderLayer, Segment
from splitllm.model.config import ModelConfig
from splitllm.model.quant import BlockedLinear

_ACTIVATIONS = {"silu": False, "gelu_pytorch_tanh": True}  # -> the kernel's `gelu` flag


class KernelStage:
    """The kernel's view of a stage's layers, built once from the loaded weights (no copies but the norms)."""

    def __init__(self, kernels: ModuleType, cfg: ModelConfig, layers: Sequence[DecoderLayer],
                 kinds: Sequence[int]) -> None:
        self.kernels = kernels
        scale = cfg.head_dim ** -0.5 if cfg.attn_scale is None else cfg.attn_scale
        self.shape = kernels.Shape(
            hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            intermediate=cfg.intermediate_size, eps=cfg.rms_norm_eps, scale=scale, gelu=_ACTIVATIONS[cfg.hidden_act],
        )

        def projection(linear: nn.Module) -> object:
            assert isinstance(linear, BlockedLinear)  # as `supports` checked
            return kernels.Projection(linear.packed, linear.out_features, linear.bias, linear.scales)

        self.layers = [
            kernels.Layer(
                self.shape, projection(layer.qkv), projection(layer.o_proj), projection(layer.gate_up),
                projection(layer.down), layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm,
                layer.attn_out_norm, layer.mlp_out_norm, kind,
            )
            for layer, kind in zip(layers, kinds)
        ]

    @staticmethod
    def supports(cfg: ModelConfig, layers: Sequence[DecoderLayer], dtype: torch.dtype) -> bool:
        linears = [m for layer in layers for m in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
        return (
            dtype == torch.bfloat16
            and cfg.hidden_act in _ACTIVATIONS
            and all(isinstance(m, BlockedLinear) and m.packed.shape[1] * 2 == m.in_features for m in linears)
            and all(isinstance(layer.attention, KernelAttention) for layer in layers)
        )

    def __call__(self, x: torch.Tensor, caches: Sequence[KVCache],
                 segments: Sequence[Sequence[Segment]]) -> torch.Tensor:
        """x: (rows, d) bfloat16, the sequences' rows in order; segments[kind][i]: sequence i's share of
        the step for layers of that kind. Writes the new entries into each cache, returns (rows, d)."""
        sequences = [
            self.kernels.Sequence(
                row=parts[0].rows.start, count=parts[0].rows.stop - parts[0].rows.start, offset=parts[0].offset,
                k=cache.k, v=cache.v, cos=[p.cos for p in parts], sin=[p.sin for p in parts],
                masks=[None if p.mask is None else p.mask.contiguous() for p in parts],
            )
            for cache, parts in zip(caches, zip(*segments))
        ]
        return self.kernels.decode(self.shape, self.layers, x, sequences)
