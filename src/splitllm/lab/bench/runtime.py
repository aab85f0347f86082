"""`splitllm bench runtime`: what the split runtime itself costs on the default model, per precision.

(a) the machine's memory read bandwidth, and one server forward through the middle layers for 1/8/32
    new positions over a context of 512, per precision and thread count, against the floor set by
    reading the stage's weight bytes once at that bandwidth; the client's compute for one token;
(b) load time, cold (GGUF conversion into an empty cache) and cached per precision;
(c) peak RSS of a process that loads the server's layers (per precision) against the whole model;
(d) sequential decoding through a `splitllm serve` subprocess, direct and behind the WAN proxy, in
    the fastest precision and in the float32 exact mode, with the mean per-step decomposition, and the
    speculative modes at the largest RTT in the fastest precision;
(e) how many generations stay token-identical to a float32 wire with float16 / bfloat16 wires.

Loads and RSS are measured in fresh subprocesses so neither caches nor earlier allocations flatter
them. Timed sections first wait (boundedly) for the rest of the machine to calm down and record the
cores it used meanwhile.
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

from splitllm.lab.bench.quiet import OtherLoad, wait_quiet
from splitllm.lab.data.workload import workload
from splitllm.client.local import LocalModel
from splitllm.client.session import Generation, SplitClient
from splitllm.decoding.speculation_config import SPECULATIVE_MODES as MODES
from splitllm.lab.launch import ServerProcess
from splitllm.model.precision import EXACT, Precision, fastest
from splitllm.model.stage import Stage
from splitllm.model.weights import ModelFiles
from splitllm.lab.netem import LinkProfile, ProxyThread
from splitllm.server.app import MiddleServer, ServerSettings
from splitllm.stats import mean_stats
from splitllm.threads import set_compute_threads
from splitllm.visibility import Visibility

Progress = Callable[[str], None]
FORWARD_TOKENS = (1, 8, 32)
GEMMA_VOCAB = 262_144
CONTEXT = 512
# Compute dtype and weight quantization, the same on both sides; the first is the exact mode.
SETTINGS = ("float32-none", "bfloat16-none", "bfloat16-int8", "bfloat16-int4")
TARGETS = {
    "server_1_token_ms_bfloat16-none": 15.0,
    "server_1_token_ms_bfloat16-int8": 9.0,
    "server_1_token_floor_ratio": 1.3,
    "client_1_token_ms": 6.0,
    "sequential_tok_s_at_0ms": 40.0,
    "sequential_tok_s_at_80ms": 9.5,
    "speedup_over_float32_at_0ms": 1.6,
}
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
    """Memory bandwidth at the current thread count: a large tensor copy (bytes read + written) and a pure read (sum)."""
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


def _weight_bytes(module: torch.nn.Module) -> int:
    """Bytes a forward reads once: parameters and (quantized) buffers."""
    return sum(t.nbytes for t in (*module.parameters(), *module.buffers()))


def server_forward(
    model: str | None,
    head: int,
    tail: int,
    bandwidth_gb_s: float,
    precision: Precision = Precision(),
    context: int = CONTEXT,
) -> dict[str, Any]:
    """Median time of the server's stage over `context` committed positions, per step size.

    Each timed step drops the previous one's entries (keep=[]), so every step sees the same context.
    Two floors: the weight bytes read once at the measured bandwidth, and those plus the KV cache a
    one-position step's attention reads. Where the stage runs fused (`model/fused.py`), the one-position
    step is also timed layer by layer, for the ratio.
    """
    server = MiddleServer(model, ServerSettings(head=head, tail=tail, dtype=precision.dtype, quant=precision.quant))
    stage = server.stage
    weight_bytes = _weight_bytes(stage)
    d = stage.cfg.hidden_size
    gen = torch.Generator().manual_seed(0)
    cache = stage.new_cache(context + max(FORWARD_TOKENS))
    stage(cache, torch.randn(context, d, generator=gen), torch.arange(context), Visibility.chain(context), [])
    stage(cache, torch.randn(1, d, generator=gen), torch.tensor([context]), Visibility.chain(1), list(range(context)))
    cache_bytes = cache.nbytes * (context + 1) // cache.max_context  # keys and values of every layer
    floor_ms = weight_bytes / bandwidth_gb_s / 1e6
    cache_floor_ms = (weight_bytes + cache_bytes) / bandwidth_gb_s / 1e6
    rows = {}
    wait_quiet([os.getpid()], QUIET_CORES, timeout_s=QUIET_WAIT_S)
    for n in FORWARD_TOKENS:
        hidden, positions = torch.randn(n, d, generator=gen), torch.arange(context, context + n)
        vis = Visibility.chain(n)

        def step() -> None:
            stage(cache, hidden, positions, vis, [])

        with OtherLoad([os.getpid()]) as others:
            timing = _median_ms(step, repeats=max(12, 60 // n))
            if n == 1 and stage.fused:
                stage.fuse = False
                timing["layered_ms"] = _median_ms(step, repeats=12)["median_ms"]
                stage.fuse = True
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
    head: int, tail: int, precision: Precision, context: int = CONTEXT, model: str | None = None
) -> dict[str, Any]:
    """The client's compute for one new token over `context`: embedding, head layers, tail layers, LM head."""
    local = LocalModel(ModelFiles(model), head, tail, precision)
    caches = local.new_caches(context + 1)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, local.cfg.vocab_size, (context,), generator=gen)
    chain = Visibility.chain(context)
    local.run_tail(caches, local.run_head(caches, tokens, torch.arange(context), chain, []), torch.arange(context), chain, [])
    keep = list(range(context))
    token, position, one = tokens[:1], torch.tensor([context]), Visibility.chain(1)

    def step() -> None:
        hidden = local.run_head(caches, token, position, one, keep)
        local.logits(local.run_tail(caches, hidden, position, one, keep))
        keep.clear()

    wait_quiet([os.getpid()], QUIET_CORES, timeout_s=QUIET_WAIT_S)
    with OtherLoad([os.getpid()]) as others:
        timing = _median_ms(step, repeats=30)
    return {
        **timing, "precision": precision.name, "weight_bytes": _weight_bytes_local(local),
        "lm_head_bytes": _weight_bytes(local.lm_head), "others_cores": others.cores,
    }


def _weight_bytes_local(local: LocalModel) -> int:
    stages = [local.head, local.tail] if local.tail else [local.head]
    return sum(_weight_bytes(s) for s in stages) + _weight_bytes(local.lm_head) + local.norm.nbytes


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


def child(kind: str, head: int | str, tail: int | str, setting: str = "float32-none") -> dict[str, float]:
    """One measurement in this (fresh) process: 'load', 'server_rss' or 'full_rss'."""
    set_compute_threads(1)
    head, tail = int(head), int(tail)
    precision = Precision.from_name(setting)
    settings = ServerSettings(head=head, tail=tail, dtype=precision.dtype, quant=precision.quant)
    baseline = _rss_mib()["now"]
    t0 = time.perf_counter()
    if kind == "load":
        files = ModelFiles(None)  # converts the GGUF when the cache is empty
        t1 = time.perf_counter()
        server = MiddleServer(None, settings)  # fingerprint + middle layers
        t2 = time.perf_counter()
        LocalModel(files, head, tail, precision)
        t3 = time.perf_counter()
        assert server.fingerprint == files.fingerprint
        return {"resolve_s": t1 - t0, "server_s": t2 - t1, "client_s": t3 - t2, "total_s": t3 - t0}
    if kind == "server_rss":
        server = MiddleServer(None, settings)
        weights = _weight_bytes(server.stage)
    elif kind == "full_rss":
        files = ModelFiles(None)
        stage = Stage.load(files, 0, files.config.num_layers, torch.float32)
        rest = files.read(["model.embed_tokens.weight", "model.norm.weight"], torch.float32)
        for t in rest.values():
            t.sum()  # a read tensor may be a file mapping nothing touched yet; in use it is resident
        weights = _weight_bytes(stage) + sum(t.nbytes for t in rest.values())
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


def _in_subprocess(
    kind: str, head: int, tail: int, setting: str = "float32-none", env: dict[str, str] | None = None
) -> dict[str, float]:
    code = "import json, sys; from splitllm.lab.bench.runtime import child; print(json.dumps(child(*sys.argv[1:])))"
    command = [sys.executable, "-c", code, kind, str(head), str(tail), setting]
    proc = subprocess.run(command, env={**os.environ, **(env or {})}, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"measurement {kind} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def load_times(head: int, tail: int, settings: Sequence[str]) -> dict[str, dict[str, float]]:
    """Cold: GGUF conversion into an empty cache (exact mode); then each setting's first (converting) and cached load."""
    with tempfile.TemporaryDirectory(prefix="splitllm-cold-") as empty:
        out = {"cold": _in_subprocess("load", head, tail, env={"SPLITLLM_CACHE": empty})}
        for setting in settings:
            if setting != "float32-none":
                out[f"first {setting}"] = _in_subprocess("load", head, tail, setting, {"SPLITLLM_CACHE": empty})
    for setting in settings:
        out[f"cached {setting}"] = _in_subprocess("load", head, tail, setting)
    return out


def peak_rss(head: int, tail: int, settings: Sequence[str]) -> dict[str, dict[str, float]]:
    out = {f"server {s}": _in_subprocess("server_rss", head, tail, s) for s in settings}
    return {**out, "full_model float32-none": _in_subprocess("full_rss", head, tail)}


# --- through a real server ----------------------------------------------------------------------------


_DECOMPOSITION = (
    "head_ms", "serialize_ms", "round_trip_ms", "network_ms", "server_ms", "deserialize_ms", "tail_ms", "decode_ms",
    "other_ms", "total_ms",
)


def _generate_all(client: SplitClient, prompts: Sequence[str], new_tokens: int, decode: str = "sequential") -> list[Generation]:
    return [client.generate(p, new_tokens, decode) for p in prompts]


def decoding(
    server: ServerProcess,
    head: int,
    tail: int,
    prompts: Sequence[str],
    new_tokens: int,
    rtts: Sequence[float],
    wire_dtype: str,
    progress: Progress,
    precision: Precision = Precision(),
    decode: str = "sequential",
) -> dict[str, Any]:
    """tok/s and the mean decode step's decomposition, per emulated RTT (the client in `precision`)."""
    assert server.proc is not None
    ours = [os.getpid(), server.proc.pid]
    out = {}
    for rtt in rtts:
        with ProxyThread("127.0.0.1", server.port, LinkProfile(rtt_ms=rtt)) if rtt else nullcontext() as proxy:
            url = f"ws://127.0.0.1:{proxy.port}" if proxy else server.url
            client = SplitClient(None, url, head, tail, wire_dtype, precision=precision)
            client.generate(prompts[0], 4, decode)  # connect once and warm every code path
            wait_quiet(ours, QUIET_CORES, timeout_s=QUIET_WAIT_S)
            with OtherLoad(ours) as others:
                gens = _generate_all(client, prompts, new_tokens, decode)
        steps = [s for g in gens for s in g.steps[1:]]
        tokens = sum(s.accepted for s in steps)
        seconds = sum(s.total_ms for s in steps) / 1000
        mean = mean_stats(steps)
        out[f"{rtt:g}"] = {
            "rtt_ms": rtt,
            "decode": decode,
            "tokens": tokens,
            "tok_s": tokens / seconds,
            "tokens_per_step": tokens / max(len(steps), 1),
            "mean_step_ms": {k: mean[k] for k in _DECOMPOSITION},
            "bytes_up": mean["bytes_up"],
            "bytes_down": mean["bytes_down"],
            "others_cores": others.cores,
        }
        progress(
            f"  {precision.name} {decode} at rtt {rtt:g} ms: {tokens / seconds:.2f} tok/s, mean step "
            f"{mean['total_ms']:.1f} ms (other processes used {others.cores:.2f} cores)"
        )
    return out


def wire_dtypes(
    server_url: str, head: int, tail: int, prompts: Sequence[str], new_tokens: int, progress: Progress
) -> dict[str, Any]:
    """Generations over a float16 / bfloat16 wire compared token by token with a float32 wire."""
    runs = {}
    for dtype in ("float32", "float16", "bfloat16"):
        client = SplitClient(None, server_url, head, tail, dtype, precision=EXACT)
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
    settings: Sequence[str] = SETTINGS,
    fast: str | None = None,
    threads: Sequence[int] = (1, 2),
    modes: Sequence[str] = tuple(MODES),
    progress: Progress = lambda line: print(line, file=sys.stderr, flush=True),
) -> dict[str, Any]:
    """Run (a)-(e) on the default model, write the JSON and Markdown reports; `prompts`/`dtype_prompts` per category.

    Decoding runs client and server one thread each (they share the cores); the server forward runs
    at every thread count of `threads`.
    """
    set_compute_threads(1)
    fast = fast or fastest().name
    result: dict[str, Any] = {
        "model": "default", "split": [head, tail], "settings": list(settings), "fastest": fast, "targets": TARGETS,
    }
    # Fresh subprocesses first, while this process is still small: ru_maxrss carries over into children.
    progress("(b) load time, cold and cached, per setting")
    result["load"] = load_times(head, tail, settings)
    progress("(c) peak RSS: server per setting vs full model")
    result["memory"] = peak_rss(head, tail, settings)
    progress("(a) memory bandwidth, server forward and client step per setting")
    result["bandwidth"], result["server_forward"], result["client_step"] = {}, {}, {}
    for n in threads:
        set_compute_threads(n)
        bw = result["bandwidth"][str(n)] = copy_bandwidth()
        for setting in settings:
            fwd = server_forward(None, head, tail, bw["read_gb_s"], Precision.from_name(setting))
            result["server_forward"][f"{setting} {n}t"] = fwd
            progress(f"  {setting}, {n} thread(s): 1 token {fwd['tokens']['1']['median_ms']:.1f} ms "
                     f"(floor {fwd['floor_ms']:.1f} ms)")
            result["client_step"][f"{setting} {n}t"] = client_step(head, tail, Precision.from_name(setting))
    set_compute_threads(1)
    progress(f"(a') Gemma 3's client step per setting: its LM head has {GEMMA_VOCAB:,} rows")
    result["client_step_gemma3"] = {s: client_step(head, tail, Precision.from_name(s), model="gemma3") for s in settings}
    texts = [p.text for p in workload(prompts)]
    result["decoding"] = {}
    for setting in dict.fromkeys([fast, "float32-none"]):
        precision = Precision.from_name(setting)
        with ServerProcess("--head", str(head), "--tail", str(tail), "--threads", "1", *precision.serve_args()) as server:
            progress(f"(d) {setting}: sequential decoding, {len(texts)} prompts x {new_tokens} tokens, {wire_dtype} wire")
            runs = {"sequential": decoding(server, head, tail, texts, new_tokens, rtts, wire_dtype, progress, precision)}
            if setting == fastest:
                for mode in modes:
                    runs[mode] = decoding(server, head, tail, texts, new_tokens, rtts[-1:], wire_dtype, progress, precision, mode)
            result["decoding"][setting] = runs
            if setting == "float32-none":
                texts_e = [p.text for p in workload(dtype_prompts)]
                progress(f"(e) wire dtypes, {len(texts_e)} prompts x {new_tokens} tokens")
                result["wire_dtypes"] = wire_dtypes(server.url, head, tail, texts_e, new_tokens, progress)
    result["decoding_wire_dtype"] = wire_dtype
    result["met"] = _met(result)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    path.with_suffix(".md").write_text(markdown(result))
    return result


def _met(result: dict[str, Any]) -> dict[str, bool | None]:
    """Each target against the best figure measured for it (None: not measured in this run)."""
    fwd, fastest = result["server_forward"], result["fastest"]

    def best(prefix: str, key: Callable[[dict[str, Any]], float]) -> float | None:
        values = [key(v) for k, v in fwd.items() if k.startswith(prefix + " ")]
        return min(values) if values else None

    seq = result["decoding"].get(fastest, {}).get("sequential", {})
    exact = result["decoding"].get("float32-none", {}).get("sequential", {})
    figures = {
        "server_1_token_ms_bfloat16-none": best("bfloat16-none", lambda v: v["tokens"]["1"]["median_ms"]),
        "server_1_token_ms_bfloat16-int8": best("bfloat16-int8", lambda v: v["tokens"]["1"]["median_ms"]),
        "client_1_token_ms": min((v["median_ms"] for v in result["client_step"].values()), default=None),
        "sequential_tok_s_at_0ms": seq.get("0", {}).get("tok_s"),
        "sequential_tok_s_at_80ms": seq.get("80", {}).get("tok_s"),
    }
    ratios = [min(v["tokens"]["1"]["floor_ratio"] for k, v in fwd.items() if k.startswith(s + " ")) for s in result["settings"]]
    if "0" in seq and "0" in exact:
        figures["speedup_over_float32_at_0ms"] = seq["0"]["tok_s"] / exact["0"]["tok_s"]
    met: dict[str, bool | None] = {}
    for name, target in result["targets"].items():
        if name == "server_1_token_floor_ratio":
            met[name] = bool(ratios) and max(ratios) <= target
        elif figures.get(name) is None:
            met[name] = None
        elif name.startswith(("sequential", "speedup")):
            met[name] = figures[name] >= target
        else:
            met[name] = figures[name] <= target
    return met


def _or_dash(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(result: dict[str, Any]) -> str:
    """The report as Markdown tables (what `bench runtime` prints and writes next to the JSON)."""
    split = result["split"]
    lines = [f"# Runtime, default model split {split[0]}+{split[1]}", "", "## Memory read bandwidth", "",
             "| threads | read GB/s | copy GB/s (read + write) |", "| --- | --- | --- |"]
    lines += [f"| {n} | {bw['read_gb_s']:.2f} | {bw['copy_gb_s']:.2f} |" for n, bw in result["bandwidth"].items()]
    some = next(iter(result["server_forward"].values()))
    lines += ["", f"## Server forward, layers {some['layers']}, context {some['context']}", "",
              "Floor: the stage's weight bytes read once at the read bandwidth of the same thread count; "
              "with cache: plus the keys and values a one-position step attends to. Layer by layer: the same "
              "step without the fused kernel (where the setting runs it).", "",
              "| setting | threads | weights MiB | floor ms | 1 position ms (x floor) | floor with cache ms (x) | "
              "layer by layer ms | 8 positions ms | 32 positions ms | others' cores |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key, fwd in result["server_forward"].items():
        setting, threads = key.split()
        t = fwd["tokens"]
        lines.append(
            f"| {setting} | {threads.removesuffix('t')} | {fwd['weight_bytes'] / _MIB:.0f} | {fwd['floor_ms']:.1f} | "
            f"{t['1']['median_ms']:.1f} ({t['1']['floor_ratio']:.2f}x) | "
            f"{_or_dash(fwd.get('cache_floor_ms'), '.1f')} ({_or_dash(t['1'].get('cache_floor_ratio'), '.2f')}x) | "
            f"{_or_dash(t['1'].get('layered_ms'), '.1f')} | {t['8']['median_ms']:.1f} | "
            f"{t['32']['median_ms']:.1f} | {max(r['others_cores'] for r in t.values()):.2f} |"
        )
    lines += ["", "## Client compute for one token (embedding, head and tail layers, LM head)", "",
              "| setting | threads | weights MiB | median ms | others' cores |", "| --- | --- | --- | --- | --- |"]
    for key, c in result["client_step"].items():
        setting, threads = key.split()
        lines.append(f"| {setting} | {threads.removesuffix('t')} | {c['weight_bytes'] / _MIB:.0f} | "
                     f"{c['median_ms']:.2f} | {c['others_cores']:.2f} |")
    gemma = result.get("client_step_gemma3")
    if gemma:
        lines += ["", f"## Gemma 3 270M: client compute for one token (one thread; LM head of {GEMMA_VOCAB:,} rows)", "",
                  "| setting | weights MiB | LM head MiB | median ms | others' cores |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {setting} | {c['weight_bytes'] / _MIB:.0f} | {c['lm_head_bytes'] / _MIB:.0f} | {c['median_ms']:.2f} | "
                  f"{c['others_cores']:.2f} |" for setting, c in gemma.items()]
    lines += ["", "## Load time and peak memory", "", "| load | total s | resolve s | server s | client s |",
              "| --- | --- | --- | --- | --- |"]
    lines += [f"| {k} | {v['total_s']:.2f} | {v['resolve_s']:.2f} | {v['server_s']:.2f} | {v['client_s']:.2f} |"
              for k, v in result["load"].items()]
    lines += ["", "| process | peak RSS MiB | above imports MiB | weights MiB |", "| --- | --- | --- | --- |"]
    lines += [f"| {k} | {m['peak_mib']:.0f} | {m['peak_mib'] - m['baseline_mib']:.0f} | {m['weights_mib']:.0f} |"
              for k, m in result["memory"].items()]
    lines += ["", f"## Decoding through `splitllm serve` ({result['decoding_wire_dtype']} wire, one thread per side)", "",
              "| setting | decoding | RTT ms | tok/s | tokens/step | step ms | head | server | network | tail | "
              "others' cores |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for setting, runs in result["decoding"].items():
        for decode, by_rtt in runs.items():
            for run in by_rtt.values():
                m = run["mean_step_ms"]
                lines.append(
                    f"| {setting} | {decode} | {run['rtt_ms']:g} | {run['tok_s']:.2f} | {run['tokens_per_step']:.2f} | "
                    f"{m['total_ms']:.1f} | {m['head_ms']:.1f} | {m['server_ms']:.1f} | {m['network_ms']:.1f} | "
                    f"{m['tail_ms']:.1f} | {run['others_cores']:.2f} |"
                )
    wd = result.get("wire_dtypes")
    if wd:
        lines += ["", "## Wire dtypes (float32 compute)", ""]
        lines += [f"- {d} wire: {wd[d]['identical']}/{wd['prompts']} generations of {wd['new_tokens']} tokens identical "
                  f"to a float32 wire (first differences: {wd[d]['first_difference']})" for d in ("float16", "bfloat16")]
    lines += ["", "## Targets", "", "| target | value | met |", "| --- | --- | --- |"]
    verdict = {True: "met", False: "MISSED", None: "not measured"}
    lines += [f"| {k} | {v:g} | {verdict[result['met'][k]]} |" for k, v in result["targets"].items()]
    return "\n".join(lines) + "\n"
