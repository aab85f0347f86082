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

(a) is measured in this process (`runtime_compute.py`), (b) and (c) in fresh subprocesses
(`runtime_loading.py`), (d) and (e) here; `runtime_report.py` holds the targets and the tables. Timed
sections first wait (boundedly) for the rest of the machine to calm down and record the cores it used
meanwhile.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from splitllm.client.client import Generation, SplitClient
from splitllm.decoding.speculation_config import SPECULATIVE_MODES as MODES
from splitllm.lab.bench.exactness import first_difference
from splitllm.lab.bench.quiet import OtherLoad, wait_quiet
from splitllm.lab.bench.speed_compute import QUIET_CORES, QUIET_WAIT_S, client_step, copy_bandwidth, server_forward
from splitllm.lab.bench.speed_loading import load_times, peak_rss
from splitllm.lab.bench.speed_report import GEMMA_VOCAB, TARGETS, markdown, met
from splitllm.lab.data.workload import workload
from splitllm.testing.launch import ServerProcess
from splitllm.testing.netem import LinkProfile, ProxyThread
from splitllm.model.precision import EXACT, Precision, fastest
from splitllm.stats import mean_stats
from splitllm.threads import set_compute_threads

Progress = Callable[[str], None]
# Compute dtype and weight quantization, the same on both sides; the first is the exact mode.
SETTINGS = ("float32-none", "bfloat16-none", "bfloat16-int8", "bfloat16-int4")
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
        first = [first_difference(a, b) for a, b in zip(runs[dtype], reference)]
        out[dtype] = {"identical": sum(f is None for f in first), "first_difference": first}
    return out


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
            if setting == fast:
                for mode in modes:
                    runs[mode] = decoding(server, head, tail, texts, new_tokens, rtts[-1:], wire_dtype, progress, precision, mode)
            result["decoding"][setting] = runs
            if setting == "float32-none":
                texts_e = [p.text for p in workload(dtype_prompts)]
                progress(f"(e) wire dtypes, {len(texts_e)} prompts x {new_tokens} tokens")
                result["wire_dtypes"] = wire_dtypes(server.url, head, tail, texts_e, new_tokens, progress)
    result["decoding_wire_dtype"] = wire_dtype
    result["met"] = met(result)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    path.with_suffix(".md").write_text(markdown(result))
    return result
