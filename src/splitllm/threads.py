"""How many CPU threads this process computes with, where they run, and the one thread a server does its math on."""

from __future__ import annotations

import asyncio
import ctypes
import functools
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
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


def pin_compute_threads() -> dict[int, set[int]]:
    """Give each thread of the calling thread's compute team a core of its own: thread i on the i-th
    core this thread may use. Returns each pinned thread's cores before ({} where nothing was pinned),
    for `unpin_compute_threads`.

    Between two steps a split client waits a whole round trip, and a server as long. A pool thread
    woken after such a wait (tens of ms) is often put by the kernel on the core of the thread that
    woke it (a virtual machine reports its idle vCPUs as preempted, and the scheduler avoids those),
    and the two then spin-wait for each other on one core: on a 2-core VM the default model's LM
    head took many times longer after a round trip's wait than back to back (measured in
    docs/operations.md, "A core per compute thread"). Only a team of one thread
    per core this thread may use is pinned: with fewer threads the others' cores stay free for them to
    move to, and `OMP_PROC_BIND` in the environment (`false` keeps threads free) is left to OpenMP.
    """
    threads = torch.get_num_threads()
    if threads < 2 or "OMP_PROC_BIND" in os.environ or not hasattr(os, "sched_getaffinity"):
        return {}
    cores = sorted(os.sched_getaffinity(0))
    if threads != len(cores):
        return {}
    before: dict[int, set[int]] = {}

    def pin(i: int) -> None:
        before[i] = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {cores[i]})

    return before if _on_each_thread(threads, pin) else {}


def unpin_compute_threads(before: dict[int, set[int]]) -> None:
    """Give the threads `pin_compute_threads` pinned the cores they had (the same team: same thread count)."""
    if before:
        _on_each_thread(len(before), lambda i: os.sched_setaffinity(0, before[i]))


@contextmanager
def compute_threads_pinned() -> Iterator[None]:
    """`pin_compute_threads` for a block, on the thread that computes in it; the cores are given back after."""
    before = pin_compute_threads()
    try:
        yield
    finally:
        unpin_compute_threads(before)


def _on_each_thread(threads: int, fn: Callable[[int], None]) -> bool:
    """`fn(i)` on thread i of the calling thread's OpenMP team of `threads` (libgomp keeps the same
    threads for a team of the same size, which PyTorch's parallel loops then run on); False where
    PyTorch does not parallelise with OpenMP or its runtime is not found."""
    runtime = _openmp_runtime()
    if runtime is None:
        return False
    body = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _: fn(runtime.omp_get_thread_num()))
    runtime.GOMP_parallel(body, None, threads, 0)
    return True


@functools.cache
def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime PyTorch runs its parallel loops on (the library already loaded, so the same
    thread pools), or None where PyTorch parallelises without OpenMP or it cannot be found (cached:
    every generation pins and unpins)."""
    if not torch.backends.openmp.is_available():
        return None
    try:
        with open("/proc/self/maps") as maps:
            path = next(line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line)
    except (OSError, StopIteration):
        return None
    runtime = ctypes.CDLL(path)
    runtime.omp_get_thread_num.restype = ctypes.c_int
    return runtime


class ComputeThread:
    """The one thread on which a process that serves from an event loop does all its tensor math,
    loading included; its thread team is pinned a core per thread for its life (`pin_compute_threads`).

    PyTorch's CPU thread pool (OpenMP) keeps a team of threads for every thread that starts parallel
    work. A model loaded on the main thread and run on a worker thread makes two teams, more threads
    than cores once each uses every core; libgomp then lets its idle threads sleep instead of spin,
    and every parallel region (several per layer) waits for one to wake: a server's one-position
    step took twice what the same layers take in-process (docs/operations.md).
    """

    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="splitllm-compute", initializer=pin_compute_threads
        )

    def run(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on the compute thread, waited for."""
        return self.executor.submit(fn, *args).result()

    async def run_async(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on the compute thread, awaited from an event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
