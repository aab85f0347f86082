"""Decoder math of the Llama family and Gemma 3 in plain PyTorch: RMSNorm, rotary, attention over a KV
cache, MLP. Gemma's extras (q/k norms, sandwich norms, GELU) are optional weights and config constants.

Projections are fused (q|k|v and gate|up) so a one-token step is a handful of matrix-vector
products that stream the weights once; masks are explicit, so trees and windows need no special kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from splitllm.model.config import ModelConfig, Rope

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, as the reference implementation does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class Rotary:
    """cos/sin for arbitrary absolute positions (tree nodes share positions, so no running offset)."""

    def __init__(self, rope: Rope) -> None:
        self.inv_freq = torch.tensor(rope.inv_freq, dtype=torch.float32)
        self.scaling = rope.scaling

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


@dataclass(frozen=True)
class Segment:
    """One sequence's share of a step: its rows, rotary tables, mask and where its new K/V go."""

    rows: slice
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor | None
    offset: int


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer; parameters are created empty and filled by the weight loader.

    Norm weights are stored with the config's `norm_offset` already added, so every norm is `rms_norm`.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.hidden_size, cfg.head_dim
        q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
        self.q_size, self.kv_size = q, kv

        def empty(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.input_norm = empty(d)
        self.qkv = empty(q + 2 * kv, d)
        self.qkv_bias = empty(q + 2 * kv) if cfg.qkv_bias else None
        self.o_proj = empty(d, q)
        self.post_norm = empty(d)
        self.gate_up = empty(2 * cfg.intermediate_size, d)
        self.down = empty(d, cfg.intermediate_size)
        self.q_norm = empty(hd) if cfg.qk_norm else None
        self.k_norm = empty(hd) if cfg.qk_norm else None
        self.attn_out_norm = empty(d) if cfg.sandwich_norm else None
        self.mlp_out_norm = empty(d) if cfg.sandwich_norm else None
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, segments: Sequence[Segment], kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """x: (1, rows, d), the new positions of one or more sequences stacked along rows.

        Projections and the MLP run once over all rows (they stream the weights once); attention runs per
        segment against that segment's own cache (`kv[i]`: (1, kv_heads, offset + n, head_dim) views, the
        new K/V written at the segment's offset), so sequences never see each other.
        """
        cfg = self.cfg
        h = rms_norm(x, self.input_norm, cfg.rms_norm_eps)
        qkv = F.linear(h, self.qkv, self.qkv_bias)
        outs = [self._attend(qkv[:, seg.rows], seg, k_cache, v_cache) for seg, (k_cache, v_cache) in zip(segments, kv)]
        attn = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        x = x + self._maybe_norm(F.linear(attn, self.o_proj), self.attn_out_norm)
        h = rms_norm(x, self.post_norm, cfg.rms_norm_eps)
        gate, up = F.linear(h, self.gate_up).chunk(2, dim=-1)
        return x + self._maybe_norm(F.linear(self.act(gate) * up, self.down), self.mlp_out_norm)

    def _maybe_norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        return x if weight is None else rms_norm(x, weight, self.cfg.rms_norm_eps)

    def _attend(self, qkv: torch.Tensor, seg: Segment, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        n = qkv.shape[1]
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = self._maybe_norm(q.view(1, n, cfg.num_heads, cfg.head_dim), self.q_norm)
        k = self._maybe_norm(k.view(1, n, cfg.num_kv_heads, cfg.head_dim), self.k_norm)
        q = apply_rotary(q.transpose(1, 2), seg.cos, seg.sin)
        k = apply_rotary(k.transpose(1, 2), seg.cos, seg.sin)
        k_cache[:, :, seg.offset :] = k
        v_cache[:, :, seg.offset :] = v.view(1, n, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        attn = F.scaled_dot_product_attention(
            q, k_cache, v_cache, attn_mask=seg.mask, scale=cfg.attn_scale, enable_gqa=cfg.num_heads != cfg.num_kv_heads
        )
        return attn.transpose(1, 2).reshape(1, n, self.q_size)
