"""Decoder math of the Llama family and Gemma 3 in plain PyTorch: RMSNorm, rotary, attention over a KV
cache, MLP. Gemma's extras (q/k norms, sandwich norms, GELU) are optional weights and config constants.

Projections are fused (q|k|v and gate|up) so a one-token step is a handful of matrix-vector
products that stream the weights once; masks are explicit, so trees and windows need no special kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from splitllm.model.config import ModelConfig, Rope
from splitllm.model.precision import Precision
from splitllm.model.quant import Linear

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm, PyTorch's fused kernel: in float32 the same bits as the reference implementation's
    float32 formula (checked against transformers in the exactness tests), one call instead of seven."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class Rotary:
    """cos/sin for arbitrary absolute positions (tree nodes share positions, so no running offset).

    The sine comes with rotate-half's sign folded into its first half, so applying it takes one
    swap of the halves instead of slices, a negation and a concatenation (the same bits: negation
    is exact).
    """

    def __init__(self, rope: Rope) -> None:
        self.inv_freq = torch.tensor(rope.inv_freq, dtype=torch.float32)
        self.scaling = rope.scaling

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        sign = torch.cat((-torch.ones_like(freqs), torch.ones_like(freqs)), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling * sign).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half's sign carried by `signed_sin` (see Rotary)."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return x * cos + swapped * signed_sin


@dataclass(frozen=True)
class Segment:
    """One sequence's share of a step: its rows, rotary tables, mask and where its new K/V go."""

    rows: slice
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor | None
    offset: int


_DENSE_NAMES = {"qkv": "qkv.weight", "qkv_bias": "qkv.bias", "o_proj": "o_proj.weight",
                "gate_up": "gate_up.weight", "down": "down.weight"}


def _dense_names(state_dict: dict[str, torch.Tensor], prefix: str, *_: object) -> None:
    """Weights saved when projections were bare tensors ("qkv", "qkv_bias", ...) load into the linear modules."""
    for old, new in _DENSE_NAMES.items():
        if prefix + old in state_dict:
            state_dict[prefix + new] = state_dict.pop(prefix + old)


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer; parameters are created empty and filled by the weight loader.

    Norm weights are stored with the config's `norm_offset` already added, so every norm is `rms_norm`.
    """

    def __init__(self, cfg: ModelConfig, precision: Precision) -> None:
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.hidden_size, cfg.head_dim
        q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
        self.q_size, self.kv_size = q, kv
        dtype, device = precision.dtype, precision.torch_device

        def empty(*shape: int) -> torch.Tensor:
            return torch.empty(*shape, dtype=dtype, device=device)

        def norm(size: int, present: bool = True) -> nn.Parameter | None:
            return nn.Parameter(empty(size), requires_grad=False) if present else None

        self.input_norm = cast(nn.Parameter, norm(d))  # present: never None
        # Linear modules: dense here; the loader swaps in the stored (possibly quantized) ones.
        self.qkv: nn.Module = Linear(empty(q + 2 * kv, d), empty(q + 2 * kv) if cfg.qkv_bias else None)
        self.o_proj: nn.Module = Linear(empty(d, q))
        self.post_norm = cast(nn.Parameter, norm(d))
        self.gate_up: nn.Module = Linear(empty(2 * cfg.intermediate_size, d))
        self.down: nn.Module = Linear(empty(d, cfg.intermediate_size))
        self.q_norm = norm(hd, cfg.qk_norm)
        self.k_norm = norm(hd, cfg.qk_norm)
        self.attn_out_norm = norm(d, cfg.sandwich_norm)
        self.mlp_out_norm = norm(d, cfg.sandwich_norm)
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.attention = precision.attention(hd)
        self._register_load_state_dict_pre_hook(_dense_names)

    def forward(self, x: torch.Tensor, segments: Sequence[Segment],
                kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """x: (1, rows, d), the new positions of one or more sequences stacked along rows.

        Projections and the MLP run once over all rows (they stream the weights once); attention runs per
        segment against that segment's own cache (`kv[i]`: (1, kv_heads, offset + n, head_dim) views, the
        new K/V written at the segment's offset), so sequences never see each other.
        """
        cfg = self.cfg
        h = rms_norm(x, self.input_norm, cfg.rms_norm_eps)
        qkv = self.qkv(h)
        outs = [self._attend(qkv[:, seg.rows], seg, k_cache, v_cache) for seg, (k_cache, v_cache) in zip(segments, kv)]
        attn = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        x = x + self._maybe_norm(self.o_proj(attn), self.attn_out_norm)
        h = rms_norm(x, self.post_norm, cfg.rms_norm_eps)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return x + self._maybe_norm(self.down(self.act(gate) * up), self.mlp_out_norm)

    def _maybe_norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        return x if weight is None else rms_norm(x, weight, self.cfg.rms_norm_eps)

    def _attend(self, qkv: torch.Tensor, seg: Segment, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Queries and keys are normed, rotated and cast to the cache's dtype together (one op each
        instead of two); the new keys and values land in the cache before attention reads it."""
        cfg = self.cfg
        n, heads = qkv.shape[1], cfg.num_heads
        qk = qkv[..., : self.q_size + self.kv_size].view(1, n, heads + cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            assert self.k_norm is not None  # the config's qk_norm makes both or neither
            eps = cfg.rms_norm_eps
            qk = torch.cat([rms_norm(qk[:, :, :heads], self.q_norm, eps), rms_norm(qk[:, :, heads:], self.k_norm, eps)],
                           2)
        qk = apply_rotary(qk.to(k_cache.dtype).transpose(1, 2), seg.cos, seg.sin)
        k_cache[:, :, seg.offset :] = qk[:, heads:]
        v_cache[:, :, seg.offset :] = qkv[..., self.q_size + self.kv_size :].view(1, n, cfg.num_kv_heads,
                                                                                  cfg.head_dim).transpose(1, 2)
        return self.attention(qk[:, :heads], k_cache, v_cache, seg.mask, cfg.attn_scale).to(qkv.dtype)
