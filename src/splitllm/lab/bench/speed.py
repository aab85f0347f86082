"""`splitllm bench speed`: what the split runtime itself costs on the default model, per precision.

(a) the machine's memory read bandwidth, and one server forward through the middle layers for 1/8/32
    new positions over a context of 512, per precision and thread count, against the floor set by
    reading the stage's weight bytes once at that bandwidth; the client's compute for one token;
(b) load time, cold (GGUF conversion into an empty cache) and cached per precision;
(c) peak RSS of a process that loads the server's layers (per precision) against the whole model;
(d) sequential decoding through a `splitllm serve` subprocess, direct and behind the WAN proxy, in
    the fastest precision and in the float32 exact mode, with the mean per-step decomposition, and the
    speculative modes at the largest RTT in the fastest precision;
(e) how many generations stay token-identical to a float32 wire with float16 / bfloat16 wires.

(a) is measured in this process (`speed_compute.py`), (b) and (c) in fresh subprocesses
(`speed_loading.py`), (d) and (e) here; `speed_report.py` holds the targets and the tables. Timed
sections first wait (boundedly) for the rest of the machine to calm down and record the cores it used
meanwhile.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
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
from splitllm.stats import SpeculationMetrics, mean_stats
from splitllm.threads import set_compute_threads

Progress = Callable[[str], None]
# Compute dtype and weight quantization, the same on both sides; the first is the exact mode.
SETTINGS = ("float32-none", "bfloat16-none", "bfloat16-int8", "bfloat16-int4")
_DECOMPOSITION = (
    "first_ms", "serialize_ms", "round_trip_ms", "network_ms", "server_ms", "deserialize_ms", "last_ms", "decode_ms",
    "other_ms", "total_ms",
)


def _generate_all(client: SplitClient, prompts: Sequence[str], new_tokens: int,
                  decode: str = "sequential") -> list[Generation]:
    return [client.generate(p, new_tokens, decode) for p in prompts]


def decoding(
    server: ServerProcess,
    first: int,
    last: int,
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
            client = SplitClient(None, url, first, last, wire_dtype, precision=precision)
            client.generate(prompts[0], 4, decode)  # connect once and warm every code path
            wait_quiet(ours, QUIET_CORES, timeout_s=QUIET_WAIT_S)
            with OtherLoad(ours) as others:
                gens = _generate_all(client, prompts, new_tokens, decode)
        steps = [s for g in gens for s in g.steps[1:]]
        metrics = SpeculationMetrics.of(steps)
        tokens = metrics.tokens
        seconds = sum(s.timing.total_ms for s in steps) / 1000
        mean = mean_stats(steps)
        out[f"{rtt:g}"] = {
            "rtt_ms": rtt,
            "decode": decode,
            "tokens": tokens,
            "tok_s": tokens / seconds,
            "tokens_per_step": metrics.tokens_per_step,
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
    server_url: str, first: int, last: int, prompts: Sequence[str], new_tokens: int, progress: Progress
) -> dict[str, Any]:
    """Generations over a float16 / bfloat16 wire compared token by token with a float32 wire."""
    runs = {}
    for dtype in ("float32", "float16", "bfloat16"):
        client = SplitClient(None, server_url, first, last, dtype, precision=EXACT)
        runs[dtype] = [g.ids for g in _generate_all(client, prompts, new_tokens)]
        progress(f"  {dtype} wire done")
    reference = runs["float32"]
    out: dict[str, Any] = {"prompts": len(prompts), "new_tokens": new_tokens}
    for dtype in ("float16", "bfloat16"):
        differences = [first_difference(a, b) for a, b in zip(runs[dtype], reference)]
        out[dtype] = {"identical": sum(f is None for f in differences), "first_difference": differences}
    return out


@dataclass(frozen=True)
class SpeedBench:
    """What `run_speed` measures: the split, the workload (`prompts`/`dtype_prompts` per category), the
    links, the settings and the thread counts of the server forward; `fast`: the setting decoded end to
    end next to float32-none (None: the fastest here)."""

    out: str | Path = "results/runtime.json"
    first: int = 2
    last: int = 2
    prompts: int = 1
    new_tokens: int = 64
    rtts: Sequence[float] = (0.0, 80.0)
    wire_dtype: str = "float16"
    dtype_prompts: int = 2
    settings: Sequence[str] = SETTINGS
    fast: str | None = None
    threads: Sequence[int] = (1, 2)
    modes: Sequence[str] = tuple(MODES)


def run_speed(
    bench: SpeedBench = SpeedBench(), progress: Progress = lambda line: print(line, file=sys.stderr, flush=True)
) -> dict[str, Any]:
    """Run (a)-(e) on the default model, write the JSON and Markdown reports.

    Decoding runs client and server one thread each (they share the cores); the server forward runs
    at every thread count of `bench.threads`.
    """
    set_compute_threads(1)
    bench = replace(bench, fast=bench.fast or fastest().name)
    result: dict[str, Any] = {
        "model": "default", "split": [bench.first, bench.last], "settings": list(bench.settings), "fastest": bench.fast,
        "targets": TARGETS,
    }
    # Fresh subprocesses first, while this process is still small: ru_maxrss carries over into children.
    progress("(b) load time, cold and cached, per setting")
    result["load"] = load_times(bench.first, bench.last, bench.settings)
    progress("(c) peak RSS: server per setting vs full model")
    result["memory"] = peak_rss(bench.first, bench.last, bench.settings)
    result |= _compute(bench, progress)
    result |= _decoding_runs(bench, progress)
    result["decoding_wire_dtype"] = bench.wire_dtype
    result["met"] = met(result)
    path = Path(bench.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    path.with_suffix(".md").write_text(markdown(result))
    return result


def _compute(bench: SpeedBench, progress: Progress) -> dict[str, Any]:
    """(a): bandwidth, server forward and client step per thread count and setting; Gemma 3's client step."""
    progress("(a) memory bandwidth, server forward and client step per setting")
    out: dict[str, Any] = {"bandwidth": {}, "server_forward": {}, "client_step": {}}
    for n in bench.threads:
        set_compute_threads(n)
        bw = out["bandwidth"][str(n)] = copy_bandwidth()
        for setting in bench.settings:
            fwd = server_forward(None, bench.first, bench.last, bw["read_gb_s"], Precision.from_name(setting))
            out["server_forward"][f"{setting} {n}t"] = fwd
            progress(f"  {setting}, {n} thread(s): 1 token {fwd['tokens']['1']['median_ms']:.1f} ms "
                     f"(floor {fwd['floor_ms']:.1f} ms)")
            out["client_step"][f"{setting} {n}t"] = client_step(bench.first, bench.last, Precision.from_name(setting))
    set_compute_threads(1)
    progress(f"(a') Gemma 3's client step per setting: its LM head has {GEMMA_VOCAB:,} rows")
    out["client_step_gemma3"] = {
        s: client_step(bench.first, bench.last, Precision.from_name(s), model="gemma3") for s in bench.settings
    }
    return out


def _decoding_runs(bench: SpeedBench, progress: Progress) -> dict[str, Any]:
    """(d) and (e): a server per setting (the fastest, then float32); every mode at the largest RTT in the
    fastest, the wire dtypes against float32's."""
    texts = [p.text for p in workload(bench.prompts)]
    out: dict[str, Any] = {"decoding": {}}
    for setting in dict.fromkeys([bench.fast, "float32-none"]):
        precision = Precision.from_name(setting)
        serve = ("--first", str(bench.first), "--last", str(bench.last), "--threads", "1", *precision.serve_args())
        with ServerProcess(*serve) as server:
            progress(f"(d) {setting}: sequential decoding, {len(texts)} prompts x {bench.new_tokens} tokens, "
                     f"{bench.wire_dtype} wire")
            run = functools.partial(decoding, server, bench.first, bench.last, texts, bench.new_tokens,
                                    wire_dtype=bench.wire_dtype, progress=progress, precision=precision)
            runs = {"sequential": run(bench.rtts)}
            if setting == bench.fast:
                for mode in bench.modes:
                    runs[mode] = run(bench.rtts[-1:], decode=mode)
            out["decoding"][setting] = runs
            if setting == "float32-none":
                texts_e = [p.text for p in workload(bench.dtype_prompts)]
                progress(f"(e) wire dtypes, {len(texts_e)} prompts x {bench.new_tokens} tokens")
                out["wire_dtypes"] = wire_dtypes(server.url, bench.first, bench.last, texts_e, bench.new_tokens,
                                                 progress)
    return out
