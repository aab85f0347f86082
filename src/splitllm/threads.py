"""How many CPU threads this process computes with: the one place that sets it."""

from __future__ import annotations

import os

import torch


def set_compute_threads(n: int) -> None:
    """Use `n` threads for tensor math (one keeps a 2-core machine's client and server apart)."""
    if n < 1:
        raise ValueError(f"threads must be at least 1, not {n}")
    torch.set_num_threads(n)


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and `taskset` narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
