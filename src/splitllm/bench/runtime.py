"""`splitllm bench runtime`: what the split runtime itself costs on the default model.

(a) one server forward through the middle layers for 1/4/16/64 new tokens, against the floor set by
    streaming those layers' weights once at the copy bandwidth measured in the same run;
(b) load time, cold (GGUF conversion into an empty cache) and cached;
(c) peak RSS of a process that loads the server's layers against one that loads the whole model;
(d) sequential decoding through a `splitllm serve` subprocess, direct and behind the WAN proxy,
    with the mean per-step time decomposition;
(e) how many generations stay token-identical to a float32 wire with float16 / bfloat16 wires.

Everything runs single-threaded (client and server share the cores); loads and RSS are measured in
fresh subprocesses so neither caches nor earlier allocations flatter them. Timed sections first wait
(boundedly) for the rest of the machine to calm down and record the cores it used meanwhile.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from splitllm.bench.quiet import OtherLoad, wait_quiet
from splitllm.bench.workload import workload
from splitllm.client.local import LocalModel
from splitllm.client.session import Generation, SplitClient
from splitllm.launch import ServerProcess
from splitllm.model.stage import Stage
from splitllm.model.weights import ModelFiles
from splitllm.netem import LinkProfile, ProxyThread
from splitllm.server.app import MiddleServer, ServerSettings
from splitllm.stats import mean_stats
from splitllm.threads import set_compute_threads
from splitllm.visibility import Visibility

Progress = Callable[[str], None]
FORWARD_TOKENS = (1, 4, 16, 64)
TARGETS = {"server_forward_1_token_ms": 35.0, "sequential_tok_s_at_80ms": 7.5}
# Timed sections wait (a bounded time) until other processes use under this many cores, and record
# how many they used meanwhile: on a shared machine that says how much to trust each figure.
QUIET_CORES, QUIET_WAIT_S = 0.5, 30.0
_MIB = 1 << 20


def _median_ms(fn: Callable[[], object], repeats: int, warmup: int = 3) -> dict[str, float]:
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


def copy_bandwidth(mib: int = 512, repeats: int = 7) -> dict[str, float]:
    """Single-thread memory bandwidth: a large tensor copy (bytes read + written) and a pure read (sum)."""
    src = torch.ones(mib * _MIB // 4)
    dst = torch.empty_like(src)
    copy = _median_ms(lambda: dst.copy_(src), repeats, warmup=2)
    read = _median_ms(lambda: src.sum(), repeats, warmup=2)
    nbytes = src.nbytes
    return {
        "buffer_mib": mib,
        "copy_gb_s": 2 * nbytes / copy["median_ms"] / 1e6,
        "read_gb_s": nbytes / read["median_ms"] / 1e6,
    }


def server_forward(
    model: str | None,
    head: int,
    tail: int,
    bandwidth_gb_s: float,
    context: int = 128,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Median time of the server's stage over `context` committed positions, per step size.

    Each timed step drops the previous one's entries (keep=[]), so every step sees the same context.
    """
    server = MiddleServer(model, ServerSettings(head=head, tail=tail, dtype=dtype))
    stage = server.stage
    weight_bytes = sum(p.numel() * p.element_size() for p in stage.parameters())
    d = stage.cfg.hidden_size
    gen = torch.Generator().manual_seed(0)
    cache = stage.new_cache(context + max(FORWARD_TOKENS))
    stage(cache, torch.randn(context, d, generator=gen), torch.arange(context), Visibility.chain(context), [])
    stage(cache, torch.randn(1, d, generator=gen), torch.tensor([context]), Visibility.chain(1), list(range(context)))
    floor_ms = weight_bytes / bandwidth_gb_s / 1e6
    rows = {}
    wait_quiet([os.getpid()], QUIET_CORES, timeout_s=QUIET_WAIT_S)
    for n in FORWARD_TOKENS:
        hidden, positions = torch.randn(n, d, generator=gen), torch.arange(context, context + n)
        vis = Visibility.chain(n)
        with OtherLoad([os.getpid()]) as others:
            timing = _median_ms(lambda: stage(cache, hidden, positions, vis, []), repeats=max(12, 60 // n))
        rows[str(n)] = {
            **timing, "floor_ms": floor_ms, "floor_ratio": timing["median_ms"] / floor_ms, "others_cores": others.cores
        }
    return {
        "layers": [stage.start, stage.end],
        "dtype": str(dtype).removeprefix("torch."),
        "context": context,
        "weight_bytes": weight_bytes,
        "floor_ms": floor_ms,
        "tokens": rows,
    }


# --- measured in fresh subprocesses -------------------------------------------------------------------


def _rss_mib() -> dict[str, float]:
    """This process's resident memory: now (VmRSS), at its peak (VmHWM), and ru_maxrss.

    ru_maxrss survives fork and exec, so a child started by a bigger process reports at least the
    parent's size; VmHWM belongs to the address space exec created, hence the figure compared.
    """
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {
        "now": int(status["VmRSS"].split()[0]) / 1024,
        "peak": int(status["VmHWM"].split()[0]) / 1024,
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
    }


def child(kind: str, head: int | str, tail: int | str) -> dict[str, float]:
    """One measurement in this (fresh) process: 'load', 'server_rss' or 'full_rss'."""
    set_compute_threads(1)
    head, tail = int(head), int(tail)
    baseline = _rss_mib()["now"]
    t0 = time.perf_counter()
    if kind == "load":
        files = ModelFiles(None)  # converts the GGUF when the cache is empty
        t1 = time.perf_counter()
        server = MiddleServer(None, ServerSettings(head=head, tail=tail))  # fingerprint + middle layers
        t2 = time.perf_counter()
        LocalModel(files, head, tail)
        t3 = time.perf_counter()
        assert server.fingerprint == files.fingerprint
        return {"resolve_s": t1 - t0, "server_s": t2 - t1, "client_s": t3 - t2, "total_s": t3 - t0}
    if kind == "server_rss":
        server = MiddleServer(None, ServerSettings(head=head, tail=tail))
        weights = sum(p.nbytes for p in server.stage.parameters())
    elif kind == "full_rss":
        files = ModelFiles(None)
        stage = Stage.load(files, 0, files.config.num_layers, torch.float32)
        rest = files.read(["model.embed_tokens.weight", "model.norm.weight"], torch.float32)
        for t in rest.values():
            t.sum()  # a read tensor may be a file mapping nothing touched yet; in use it is resident
        weights = sum(p.nbytes for p in stage.parameters()) + sum(t.nbytes for t in rest.values())
    else:
        raise ValueError(f"unknown measurement {kind!r}")
    peak = _rss_mib()
    return {
        "baseline_mib": baseline,
        "peak_mib": peak["peak"],
        "ru_maxrss_mib": peak["ru_maxrss"],
        "weights_mib": weights / _MIB,
        "load_s": time.perf_counter() - t0,
    }


def _in_subprocess(kind: str, head: int, tail: int, env: dict[str, str] | None = None) -> dict[str, float]:
    code = "import json, sys; from splitllm.bench.runtime import child; print(json.dumps(child(*sys.argv[1:])))"
    command = [sys.executable, "-c", code, kind, str(head), str(tail)]
    proc = subprocess.run(command, env={**os.environ, **(env or {})}, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"measurement {kind} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def load_times(head: int, tail: int) -> dict[str, dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="splitllm-cold-") as empty:
        cold = _in_subprocess("load", head, tail, {"SPLITLLM_CACHE": empty})
    return {"cold": cold, "cached": _in_subprocess("load", head, tail)}


def peak_rss(head: int, tail: int) -> dict[str, dict[str, float]]:
    return {"server": _in_subprocess("server_rss", head, tail), "full_model": _in_subprocess("full_rss", head, tail)}


# --- through a real server ----------------------------------------------------------------------------


_DECOMPOSITION = (
    "head_ms", "serialize_ms", "round_trip_ms", "network_ms", "server_ms", "deserialize_ms", "tail_ms", "decode_ms",
    "other_ms", "total_ms",
)


def _generate_all(client: SplitClient, prompts: Sequence[str], new_tokens: int) -> list[Generation]:
    return [client.generate(p, new_tokens, "sequential") for p in prompts]


def decoding(
    server: ServerProcess,
    head: int,
    tail: int,
    prompts: Sequence[str],
    new_tokens: int,
    rtts: Sequence[float],
    wire_dtype: str,
    progress: Progress,
) -> dict[str, Any]:
    """Sequential tok/s and the mean decode step's decomposition, per emulated RTT."""
    assert server.proc is not None
    ours = [os.getpid(), server.proc.pid]
    out = {}
    for rtt in rtts:
        with ProxyThread("127.0.0.1", server.port, LinkProfile(rtt_ms=rtt)) if rtt else nullcontext() as proxy:
            url = f"ws://127.0.0.1:{proxy.port}" if proxy else server.url
            client = SplitClient(None, url, head, tail, wire_dtype)
            client.generate(prompts[0], 4, "sequential")  # connect once and warm every code path
            wait_quiet(ours, QUIET_CORES, timeout_s=QUIET_WAIT_S)
            with OtherLoad(ours) as others:
                gens = _generate_all(client, prompts, new_tokens)
        steps = [s for g in gens for s in g.steps[1:]]
        tokens = sum(s.accepted for s in steps)
        seconds = sum(s.total_ms for s in steps) / 1000
        mean = mean_stats(steps)
        out[f"{rtt:g}"] = {
            "rtt_ms": rtt,
            "tokens": tokens,
            "tok_s": tokens / seconds,
            "mean_step_ms": {k: mean[k] for k in _DECOMPOSITION},
            "bytes_up": mean["bytes_up"],
            "bytes_down": mean["bytes_down"],
            "others_cores": others.cores,
        }
        progress(
            f"  rtt {rtt:g} ms: {tokens / seconds:.2f} tok/s, mean step {mean['total_ms']:.1f} ms "
            f"(other processes used {others.cores:.2f} cores)"
        )
    return out


def wire_dtypes(
    server_url: str, head: int, tail: int, prompts: Sequence[str], new_tokens: int, progress: Progress
) -> dict[str, Any]:
    """Generations over a float16 / bfloat16 wire compared token by token with a float32 wire."""
    runs = {}
    for dtype in ("float32", "float16", "bfloat16"):
        client = SplitClient(None, server_url, head, tail, dtype)
        runs[dtype] = [g.ids for g in _generate_all(client, prompts, new_tokens)]
        progress(f"  {dtype} wire done")
    reference = runs["float32"]
    out: dict[str, Any] = {"prompts": len(prompts), "new_tokens": new_tokens}
    for dtype in ("float16", "bfloat16"):
        first = [_first_difference(a, b) for a, b in zip(runs[dtype], reference)]
        out[dtype] = {"identical": sum(f is None for f in first), "first_difference": first}
    return out


def _first_difference(a: list[int], b: list[int]) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# --- the whole benchmark ------------------------------------------------------------------------------


def run_runtime(
    out: str | Path = "results/runtime.json",
    head: int = 2,
    tail: int = 2,
    prompts: int = 1,
    new_tokens: int = 64,
    rtts: Sequence[float] = (0.0, 80.0),
    wire_dtype: str = "float16",
    dtype_prompts: int = 2,
    progress: Progress = lambda line: print(line, file=sys.stderr, flush=True),
) -> dict[str, Any]:
    """Run (a)-(e) on the default model and write the JSON report; `prompts`/`dtype_prompts` per workload category."""
    set_compute_threads(1)
    result: dict[str, Any] = {"model": "default", "split": [head, tail], "threads": 1, "targets": TARGETS}
    # Fresh subprocesses first, while this process is still small: ru_maxrss carries over into children.
    progress("(b) load time, cold and cached")
    result["load"] = load_times(head, tail)
    progress("(c) peak RSS: server vs full model")
    result["memory"] = peak_rss(head, tail)
    progress("(a) memory bandwidth and server forward")
    result["bandwidth"] = copy_bandwidth()
    result["server_forward"] = server_forward(None, head, tail, result["bandwidth"]["copy_gb_s"])
    progress(f"  1 token: {result['server_forward']['tokens']['1']['median_ms']:.1f} ms")
    # For comparison: `serve --dtype bfloat16` streams half the bytes (not exact against float32).
    result["server_forward_bfloat16"] = server_forward(
        None, head, tail, result["bandwidth"]["copy_gb_s"], dtype=torch.bfloat16
    )
    texts = [p.text for p in workload(prompts)]
    with ServerProcess("--head", str(head), "--tail", str(tail), "--threads", "1") as server:
        progress(f"(d) sequential decoding, {len(texts)} prompts x {new_tokens} tokens, {wire_dtype} wire")
        result["decoding"] = decoding(server, head, tail, texts, new_tokens, rtts, wire_dtype, progress)
        texts = [p.text for p in workload(dtype_prompts)]
        progress(f"(e) wire dtypes, {len(texts)} prompts x {new_tokens} tokens")
        result["wire_dtypes"] = wire_dtypes(server.url, head, tail, texts, new_tokens, progress)
    result["decoding_wire_dtype"] = wire_dtype
    one = result["server_forward"]["tokens"]["1"]["median_ms"]
    at80 = result["decoding"].get("80", {}).get("tok_s")
    result["met"] = {
        "server_forward_1_token_ms": one <= TARGETS["server_forward_1_token_ms"],
        "sequential_tok_s_at_80ms": at80 is not None and at80 >= TARGETS["sequential_tok_s_at_80ms"],
    }
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return result


def summary(result: dict[str, Any]) -> str:
    """Human-readable lines of a runtime report."""
    bw = result["bandwidth"]
    lines = [
        f"memory bandwidth (1 thread): copy {bw['copy_gb_s']:.2f} GB/s (read+write), read {bw['read_gb_s']:.2f} GB/s",
    ]
    for fwd in (result["server_forward"], result["server_forward_bfloat16"]):
        lines.append(
            f"server forward, layers {fwd['layers']} ({fwd['weight_bytes'] / _MIB:.0f} MiB {fwd['dtype']}), "
            f"context {fwd['context']}; floor {fwd['floor_ms']:.1f} ms:"
        )
        for n, row in fwd["tokens"].items():
            lines.append(
                f"  {n:>3} tokens: median {row['median_ms']:.1f} ms (min {row['min_ms']:.1f}, p10 {row['p10_ms']:.1f}, "
                f"p90 {row['p90_ms']:.1f}), {row['floor_ratio']:.2f}x floor; "
                f"others used {row['others_cores']:.2f} cores"
            )
    for kind, load in result["load"].items():
        lines.append(
            f"load {kind}: {load['total_s']:.2f} s (resolve {load['resolve_s']:.2f}, server {load['server_s']:.2f}, "
            f"client {load['client_s']:.2f})"
        )
    for kind, mem in result["memory"].items():
        lines.append(
            f"peak RSS {kind}: {mem['peak_mib']:.0f} MiB ({mem['peak_mib'] - mem['baseline_mib']:.0f} above the "
            f"{mem['baseline_mib']:.0f} MiB after imports; weights {mem['weights_mib']:.0f} MiB; "
            f"ru_maxrss {mem['ru_maxrss_mib']:.0f} MiB)"
        )
    for run in result["decoding"].values():
        m = run["mean_step_ms"]
        lines.append(
            f"sequential at {run['rtt_ms']:g} ms RTT ({result['decoding_wire_dtype']} wire): {run['tok_s']:.2f} tok/s; "
            f"mean step {m['total_ms']:.1f} ms = head {m['head_ms']:.1f} + serialize {m['serialize_ms']:.2f} + "
            f"round trip {m['round_trip_ms']:.1f} (network {m['network_ms']:.1f} + server {m['server_ms']:.1f}) + "
            f"deserialize {m['deserialize_ms']:.2f} + tail {m['tail_ms']:.1f} + decode {m['decode_ms']:.2f} "
            f"+ other {m['other_ms']:.2f}; others used {run['others_cores']:.2f} cores"
        )
    wd = result["wire_dtypes"]
    for dtype in ("float16", "bfloat16"):
        lines.append(
            f"{dtype} wire: {wd[dtype]['identical']}/{wd['prompts']} generations of {wd['new_tokens']} tokens "
            f"identical to float32 (first differences: {wd[dtype]['first_difference']})"
        )
    for name, target in result["targets"].items():
        lines.append(f"target {name} {target:g}: {'met' if result['met'][name] else 'MISSED'}")
    return "\n".join(lines)
