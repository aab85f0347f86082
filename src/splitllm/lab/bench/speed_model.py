"""`splitllm bench speed --model M`: a real model's runtime beside llama.cpp on the same GGUF and cores.

(f) in-process sequential decoding per precision (every layer in this process, `threads` threads), with
    llama.cpp's whole-model decoder (`llama-bench`) on the same GGUF and thread count in the same run;
(g) the server's one-position step per precision against the floor of its weight bytes, in-process and
    in a `splitllm serve` process beside a client, each side pinned to its own cores as two machines
    would be (the figure in the other process is the server's own step time, reported on every reply);
(h) sequential decoding through the WAN proxy at `rtt_ms`, split on pinned cores, next to llama.cpp's RPC
    backend (every layer on `ggml-rpc-server`) behind the same proxy.

llama.cpp figures are left out, with the reason, when `make peers` has not built it.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitllm.client.client import SplitClient
from splitllm.lab import peers
from splitllm.lab.bench.speed_compute import copy_bandwidth, server_forward
from splitllm.lab.data.workload import workload
from splitllm.testing.launch import ServerProcess, on_cores, split_cores
from splitllm.testing.netem import LinkProfile, ProxyThread
from splitllm.kernels import cpu_kernels
from splitllm.model.precision import Precision
from splitllm.stats import SpeculationMetrics, mean_stats
from splitllm.threads import set_compute_threads

Progress = Callable[[str], None]
MODEL_SETTINGS = ("bfloat16-int8", "bfloat16-int4")


def decode_speed(client: SplitClient, prompts: Sequence[str], new_tokens: int) -> dict[str, Any]:
    client.generate(prompts[0], 4, decode="sequential")  # warm every code path (and the connection)
    gens = [client.generate(p, new_tokens, decode="sequential") for p in prompts]
    steps = [s for g in gens for s in g.steps[1:]]
    tokens = SpeculationMetrics.of(steps).tokens
    ms = sum(s.timing.total_ms for s in steps)
    mean = mean_stats(steps)
    return {"tokens": tokens, "tok_s": tokens / ms * 1000 if ms else 0.0,
            "mean_step_ms": {k: mean[k] for k in ("first_ms", "network_ms", "server_ms", "last_ms", "total_ms")}}


@dataclass(frozen=True)
class _Split:
    """The model, its split and the prompts every part of the benchmark decodes."""

    model: str
    first: int
    last: int
    wire_dtype: str
    texts: tuple[str, ...]
    new_tokens: int

    def client(self, server: str | None, precision: Precision) -> SplitClient:
        return SplitClient(self.model, server, self.first, self.last, self.wire_dtype, precision=precision)


def run_model_speed(
    model: str,
    out: str | Path = "results/runtime-model.json",
    first: int = 2,
    last: int = 2,
    settings: Sequence[str] = MODEL_SETTINGS,
    threads: int = 2,
    new_tokens: int = 128,
    rtt_ms: float = 80.0,
    prompts: int = 1,
    wire_dtype: str = "float16",
    progress: Progress = lambda line: print(line, file=sys.stderr, flush=True),
) -> dict[str, Any]:
    """(f)-(h) for `model`; writes the JSON and a Markdown table beside it."""
    split = _Split(model, first, last, wire_dtype, tuple(p.text for p in workload(prompts)), new_tokens)
    server_cores, client_cores = cores = split_cores()
    result: dict[str, Any] = {"model": model, "split": [first, last], "threads": threads, "new_tokens": new_tokens,
                              "rtt_ms": rtt_ms,
                              "cores": {"server": sorted(server_cores), "client": sorted(client_cores)},
                              "linear_kernels": cpu_kernels.linear_path()}
    progress(f"(f) in-process sequential decoding, {threads} threads, {len(split.texts)} prompts x {new_tokens} tokens")
    set_compute_threads(threads)
    result["in_process"] = _in_process(split, settings, progress)
    result["llama_cpp"] = peers.measured(model, lambda gguf: peers.whole_model(gguf, threads, new_tokens), progress)
    progress("(g) the server's one-position step: in-process and in its own process beside a client, pinned")
    set_compute_threads(len(server_cores))
    with on_cores(server_cores):
        result["bandwidth"] = copy_bandwidth()
    result["server_step"] = {}
    for setting in settings:
        step = result["server_step"][setting] = _server_step(split, Precision.from_name(setting), result["bandwidth"],
                                                             rtt_ms, cores)
        progress(f"  {setting}: in-process {step['in_process_ms']:.1f} ms, own process {step['own_process_ms']:.1f} ms "
                 f"({step['ratio']:.2f}x), floor {step['floor_ms']:.1f} ms; split at {rtt_ms:g} ms: "
                 f"{step[f'split_{rtt_ms:g}ms']['tok_s']:.2f} tok/s")
    progress(f"(h) llama.cpp RPC behind the proxy at {rtt_ms:g} ms")
    runs = {f"{threads} threads, unpinned": (threads, None, None),
            f"{len(server_cores)} thread(s) per side, pinned": (len(server_cores), server_cores, client_cores)}
    result["llama_cpp_rpc"] = {
        label: peers.measured(model, functools.partial(peers.rpc, threads=n, rtt_ms=rtt_ms, tokens=new_tokens,
                                                       server_cores=srv, client_cores=cli), progress)
        for label, (n, srv, cli) in runs.items()
    }
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    path.with_suffix(".md").write_text(markdown(result))
    return result


def _in_process(split: _Split, settings: Sequence[str], progress: Progress) -> dict[str, Any]:
    """(f): sequential decoding with every layer in this process, per setting."""
    rows = {}
    for setting in settings:
        client = split.client(None, Precision.from_name(setting))
        row = rows[setting] = decode_speed(client, split.texts, split.new_tokens)
        progress(f"  splitllm {setting}: {row['tok_s']:.2f} tok/s")
        del client
    return rows


def _server_step(
    split: _Split, precision: Precision, bandwidth: dict[str, Any], rtt_ms: float, cores: tuple[set[int], set[int]]
) -> dict[str, Any]:
    """(g) in one precision: the server's one-position step in-process and in its own process, against its
    floor, and the split's speed direct and at `rtt_ms`."""
    server_cores, client_cores = cores
    with on_cores(server_cores):
        forward = server_forward(split.model, split.first, split.last, bandwidth["read_gb_s"], precision)
    serve = ("--model", split.model, "--first", str(split.first), "--last", str(split.last),
             "--threads", str(len(server_cores)), *precision.serve_args())
    set_compute_threads(len(client_cores))
    with ServerProcess(*serve, cores=server_cores) as server, on_cores(client_cores):
        client = split.client(server.url, precision)
        direct = decode_speed(client, split.texts[:1], split.new_tokens)
        with ProxyThread("127.0.0.1", server.port, LinkProfile(rtt_ms=rtt_ms)) if rtt_ms else nullcontext() as proxy:
            client.server = f"ws://127.0.0.1:{proxy.port}" if proxy else server.url
            wan = decode_speed(client, split.texts, split.new_tokens)
    set_compute_threads(len(server_cores))
    own = direct["mean_step_ms"]["server_ms"]
    one = forward["tokens"]["1"]["median_ms"]
    return {
        "in_process_ms": one, "own_process_ms": own, "ratio": own / one, "idle": forward["tokens"]["1"]["idle"],
        "floor_ms": forward["floor_ms"],
        "floor_ratio": one / forward["floor_ms"], "weight_bytes": forward["weight_bytes"], "split_direct": direct,
        f"split_{rtt_ms:g}ms": wan,
    }


def markdown(r: dict[str, Any]) -> str:
    lines = [f"Runtime of {r['model']} (split {r['split'][0]}+{r['split'][1]}), {r['new_tokens']} tokens per prompt.",
             "", f"In-process sequential decoding, {r['threads']} threads:", "", "| decoder | tok/s | vs llama.cpp |",
             "| --- | --- | --- |"]
    peer = r["llama_cpp"].get("tokens_per_second")
    for setting, row in r["in_process"].items():
        lines.append(f"| splitllm {setting} | {row['tok_s']:.2f} | {row['tok_s'] / peer:.2f}x |" if peer else
                     f"| splitllm {setting} | {row['tok_s']:.2f} | - |")
    lines.append(
        f"| llama.cpp (same GGUF) | {peer:.2f} | 1.00x |" if peer else f"| llama.cpp | {r['llama_cpp']['skipped']} | |"
    )
    lines += ["", f"Server one-position step ({len(r['cores']['server'])} core(s), pinned) and the split at "
              f"{r['rtt_ms']:g} ms:", "",
              "| setting | in-process ms | own process ms | ratio | in-process, back to back / after an idle wait | "
              "floor ms | in-process / floor | split tok/s |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for setting, s in r["server_step"].items():
        wan, idle = s[f"split_{r['rtt_ms']:g}ms"]["tok_s"], s["idle"]
        lines.append(f"| {setting} | {s['in_process_ms']:.1f} | {s['own_process_ms']:.1f} | {s['ratio']:.2f}x | "
                     f"{idle['back_to_back_ms']:.1f} / {idle['after_idle_ms']:.1f} ({idle['idle_s'] * 1000:g} ms) | "
                     f"{s['floor_ms']:.1f} | {s['floor_ratio']:.2f}x | {wan:.2f} |")
    for label, row in r["llama_cpp_rpc"].items():
        text = f"{row['tokens_per_second']:.2f} tok/s" if "tokens_per_second" in row else row["skipped"]
        lines.append(f"\nllama.cpp RPC ({label}) at {r['rtt_ms']:g} ms: {text}")
    return "\n".join(lines) + "\n"
