"""How many CPU threads this process computes with: the one place that sets it."""

from __future__ import annotations

import torch


def set_compute_threads(n: int) -> None:
    """Use `n` threads for tensor math (one keeps a 2-core machine's client and server apart)."""
    if n < 1:
        raise ValueError(f"threads must be at least 1, not {n}")
    torch.set_num_threads(n)
