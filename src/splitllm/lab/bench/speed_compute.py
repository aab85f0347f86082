"""`splitllm bench speed` in this process: memory bandwidth, the server's forward against the floor its
weight bytes set, and the client's compute for one token.

Timed sections first wait (boundedly) for the rest of the machine to calm down and record the cores
it used meanwhile.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from splitllm.client.client_model import ClientModel
from splitllm.lab.bench.quiet import OtherLoad, wait_quiet
from splitllm.model.precision import Precision
from splitllm.weights.sources import ModelFiles
from splitllm.server.app import MiddleServer
from splitllm.server.settings import ServerSettings
from splitllm.model.stage import Step
from splitllm.model.visibility import Visibility

FORWARD_TOKENS = (1, 8, 32)
CONTEXT = 512
# Timed sections wait (a bounded time) until other processes use under this many cores, and record
# how many they used meanwhile: on a shared machine that says how much to trust each figure.
QUIET_CORES, QUIET_WAIT_S = 0.5, 30.0
IDLE_S = 0.015  # about a split step's round trip and client compute, which a server waits between steps
MIB = 1 << 20


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 3) -> dict[str, float]:
    """`fn` timed `repeats` times after `warmup` calls: median, minimum, 10th and 90th percentiles."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    q = statistics.quantiles(times, n=10) if len(times) > 1 else times * 9
    median, low = statistics.median(times), min(times)
    return {"median_ms": median, "min_ms": low, "p10_ms": q[0], "p90_ms": q[-1], "repeats": repeats}


def idle_cost(fn: Callable[[], object], idle_s: float = IDLE_S, rounds: int = 6, per_round: int = 4) -> dict[str,
                                                                                                             float]:
    """Median time of `fn` back to back and after `idle_s` of sleep, in alternating blocks (this host's
    speed drifts within minutes): a server's step always follows its wait for the client, a timing loop's
    does not, so this says whether the loop flatters the server (cores and thread pools gone idle)."""
    times: dict[str, list[float]] = {"back_to_back_ms": [], "after_idle_ms": []}
    fn()
    for _ in range(rounds):
        for key, samples in times.items():
            for _ in range(per_round):
                if key == "after_idle_ms":
                    time.sleep(idle_s)
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1000)
    return {"idle_s": idle_s, **{key: statistics.median(samples) for key, samples in times.items()}}


def copy_bandwidth(mib: int = 512, repeats: int = 7) -> dict[str, float]:
    """Memory bandwidth at the current thread count: a large tensor copy (bytes read + written) and a
    pure read (sum)."""
    src = torch.ones(mib * MIB // 4)
    dst = torch.empty_like(src)
    copy = median_ms(lambda: dst.copy_(src), repeats, warmup=2)
    read = median_ms(lambda: src.sum(), repeats, warmup=2)
    nbytes = src.nbytes
    return {
        "buffer_mib": mib,
        "copy_gb_s": 2 * nbytes / copy["median_ms"] / 1e6,
        "read_gb_s": nbytes / read["median_ms"] / 1e6,
    }


def weight_bytes_of(module: torch.nn.Module) -> int:
    """Bytes a forward reads once: parameters and (quantized) buffers."""
    return sum(t.nbytes for t in (*module.parameters(), *module.buffers()))


def server_forward(
    model: str | None,
    first: int,
    last: int,
    bandwidth_gb_s: float,
    precision: Precision = Precision(),
    context: int = CONTEXT,
) -> dict[str, Any]:
    """Median time of the server's stage over `context` committed positions, per step size.

    Each timed step drops the previous one's entries (keep=[]), so every step sees the same context.
    Two floors: the weight bytes read once at the measured bandwidth, and those plus the KV cache a
    one-position step's attention reads. Where the stage runs as a `KernelStage`, the one-position
    step is also timed layer by layer, for the ratio.
    """
    server = MiddleServer(model, ServerSettings(first=first, last=last, dtype=precision.dtype, quant=precision.quant))
    stage = server.stage
    weight_bytes = weight_bytes_of(stage)
    d = stage.cfg.hidden_size
    gen = torch.Generator().manual_seed(0)
    cache = stage.new_cache(context + max(FORWARD_TOKENS))
    stage(cache, Step(torch.randn(context, d, generator=gen), torch.arange(context), Visibility.chain(context)))
    stage(cache, Step(torch.randn(1, d, generator=gen), torch.tensor([context]), Visibility.chain(1), range(context)))
    cache_bytes = cache.nbytes * (context + 1) // cache.max_context  # keys and values of every layer
    floor_ms = weight_bytes / bandwidth_gb_s / 1e6
    cache_floor_ms = (weight_bytes + cache_bytes) / bandwidth_gb_s / 1e6
    rows = {}
    wait_quiet([os.getpid()], QUIET_CORES, timeout_s=QUIET_WAIT_S)
    for n in FORWARD_TOKENS:
        timed = Step(torch.randn(n, d, generator=gen), torch.arange(context, context + n), Visibility.chain(n))

        def step(timed: Step = timed) -> None:
            stage(cache, timed)

        with OtherLoad([os.getpid()]) as others:
            timing = median_ms(step, repeats=max(12, 60 // n))
            if n == 1:
                timing["idle"] = idle_cost(step)
                if stage.runs_kernel_stage:
                    stage.use_kernel_stage = False
                    timing["layered_ms"] = median_ms(step, repeats=12)["median_ms"]
                    stage.use_kernel_stage = True
        rows[str(n)] = {
            **timing, "floor_ms": floor_ms, "floor_ratio": timing["median_ms"] / floor_ms, "others_cores": others.cores
        }
    rows["1"]["cache_floor_ratio"] = rows["1"]["median_ms"] / cache_floor_ms
    return {
        "layers": [stage.start, stage.end],
        "precision": precision.name,
        "context": context,
        "weight_bytes": weight_bytes,
        "cache_bytes": cache_bytes,
        "floor_ms": floor_ms,
        "cache_floor_ms": cache_floor_ms,
        "tokens": rows,
    }


def client_step(
    first: int, last: int, precision: Precision, context: int = CONTEXT, model: str | None = None
) -> dict[str, Any]:
    """The client's compute for one new token over `context`: embedding, first stage, last stage, LM head."""
    client_model = ClientModel(ModelFiles(model), first, last, precision)
    caches = client_model.new_caches(context + 1)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, client_model.cfg.vocab_size, (context,), generator=gen)
    prefill = Step(tokens, torch.arange(context), Visibility.chain(context))
    client_model.run_last(caches, prefill.with_inputs(client_model.run_first(caches, prefill)))
    keep = list(range(context))
    token, position, one = tokens[:1], torch.tensor([context]), Visibility.chain(1)

    def step() -> None:
        one_token = Step(token, position, one, keep)
        hidden = client_model.run_first(caches, one_token)
        client_model.logits(client_model.run_last(caches, one_token.with_inputs(hidden)))
        keep.clear()

    wait_quiet([os.getpid()], QUIET_CORES, timeout_s=QUIET_WAIT_S)
    with OtherLoad([os.getpid()]) as others:
        timing = median_ms(step, repeats=30)
    return {
        **timing, "precision": precision.name, "weight_bytes": _client_weight_bytes(client_model),
        "lm_head_bytes": weight_bytes_of(client_model.lm_head), "others_cores": others.cores,
    }


def _client_weight_bytes(client_model: ClientModel) -> int:
    stages = [client_model.first, client_model.last] if client_model.last else [client_model.first]
    return sum(weight_bytes_of(s) for s in stages) + weight_bytes_of(client_model.lm_head) + client_model.norm.nbytes
