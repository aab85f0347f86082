"""How a layer attends: PyTorch's scaled-dot-product attention, or splitllm's CPU kernel in 16-bit settings.

Both take queries (1, H, n, D) and a cache view (1, KV, L, D) with an additive mask (or None) and return
(1, n, H * D). The kernel (`kernels/csrc/attention.cpp`) is faster for a few rows (docs/precision.md) and gives a row
the same bits alone, in a speculative tree or after its ancestors were committed. It serves every step
of the 16-bit precisions on the CPU, prompts included: a first speculative step carries the prompt and
a tree, so a prompt row must score the same in a step of any size (PyTorch's blocked attention is
faster for hundreds of rows, but its rows depend on the step; the server cuts long
prompts into 16-row slices anyway). The float32 exact mode always uses PyTorch's, as transformers does.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float | None], torch.Tensor]


def torch_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None
) -> torch.Tensor:
    """PyTorch's attention; `scale` None is 1 / sqrt(head size)."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2).reshape(1, q.shape[2], -1)


class KernelAttention:
    """The CPU kernel, for steps of any size."""

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels

    @staticmethod
    def supports(head_dim: int, cache_dtype: torch.dtype) -> bool:
        return head_dim % 64 == 0 and cache_dtype == torch.float32

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None
    ) -> torch.Tensor:
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return self.kernels.attention(q, k, v, None if mask is None else mask.contiguous(), scale)
