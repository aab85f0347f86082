"""How many CPU threads this process computes with, and the one thread a server does its math on."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


def set_compute_threads(n: int) -> None:
    """Use `n` threads for tensor math (one keeps a 2-core machine's client and server apart)."""
    if n < 1:
        raise ValueError(f"threads must be at least 1, not {n}")
    torch.set_num_threads(n)


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and `taskset` narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class ComputeThread:
    """The one thread on which a process that serves from an event loop does all its tensor math,
    loading included.

    PyTorch's CPU thread pool (OpenMP) keeps a team of threads for every thread that starts parallel
    work. A model loaded on the main thread and run on a worker thread makes two teams, more threads
    than cores once each uses every core; libgomp then lets its idle threads sleep instead of spin,
    and every parallel region (several per layer) waits for one to wake: a server's one-position
    step took twice what the same layers take in-process (docs/operations.md).
    """

    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="splitllm-compute")

    def run(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on the compute thread, waited for."""
        return self.executor.submit(fn, *args).result()

    async def run_async(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on the compute thread, awaited from an event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
