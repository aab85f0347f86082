"""`splitllm bench load`: many concurrent clients, through the WAN proxy, against one server process.

Clients are threads of this process sharing one LocalModel (each with its own SplitPipeline and
server session), so N of them cost one copy of the client's weights. The server (`splitllm serve`)
and the WAN emulator (`splitllm netem`) run as their own processes, as in a deployment.

Checked: every client's tokens equal its prompt's solo run (same server, nobody else connected);
the server's reserved KV bytes never exceed the bound it was started with (polled from /health,
with the server's resident memory). Reported: per-step latency p50/p99 as clients see it and as
the server computes it, time to first token, aggregate tokens/s. EOS is ignored so every client
generates exactly the requested number of tokens.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from splitllm.bench.workload import workload
from splitllm.client.connection import ConnectionOptions
from splitllm.client.pipeline import SplitPipeline
from splitllm.client.remote import RemoteMiddle
from splitllm.client.session import SplitClient
from splitllm.decoding.sequential import decode_sequential
from splitllm.launch import ServerProcess, free_port

Progress = Callable[[str], None]


@dataclass
class ClientRun:
    prompt: int
    ids: list[int] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)  # wall time of each step as the client saw it
    server_ms: list[float] = field(default_factory=list)  # the server's compute inside it
    reconnects: int = 0
    error: str | None = None


def _decode(client: SplitClient, url: str, prompt: list[int], n: int, context: int, run: ClientRun) -> ClientRun:
    files = client.files
    middle = RemoteMiddle(url, files.fingerprint, client.local.middle_range, client.wire_dtype, context, client.connection)
    try:
        pipeline = SplitPipeline(client.local, middle, context)
        last = time.perf_counter()
        for out in decode_sequential(pipeline, prompt, n, frozenset()):
            now = time.perf_counter()
            run.ids.extend(out.tokens)
            run.step_ms.append((now - last) * 1000)
            run.server_ms.append(out.stats.server_ms)
            last = now
        run.reconnects = middle.reconnects
    finally:
        middle.close()
    return run


class _Netem:
    """`splitllm netem` in a child process."""

    def __init__(self, target_port: int, rtt_ms: float) -> None:
        self.port = free_port()
        args = ["netem", "--listen", str(self.port), "--target", f"127.0.0.1:{target_port}", "--rtt", str(rtt_ms)]
        self.proc = subprocess.Popen([sys.executable, "-m", "splitllm.cli", *args], stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if "listening" not in line:
            self.close()
            raise RuntimeError(f"netem did not start: {line!r}")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


class _Watch:
    """Polls the server's /health (reserved KV bytes, sessions) and resident memory until stopped."""

    def __init__(self, port: int, pid: int) -> None:
        self.port, self.pid = port, pid
        self.peak_kv = self.peak_sessions = self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def health(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=10) as r:
            return json.loads(r.read())

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            h = self.health()
            self.peak_kv = max(self.peak_kv, h["kv_bytes"])
            self.peak_sessions = max(self.peak_sessions, h["sessions"])
            self.peak_rss = max(self.peak_rss, self.rss())

    def __enter__(self) -> _Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _percentiles(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values * 2 if len(values) == 1 else values, n=100, method="inclusive")
    return {"p50": round(q[49], 1), "p99": round(q[98], 1), "mean": round(statistics.fmean(values), 1)}


def run_load(
    clients: int = 64,
    max_new_tokens: int = 64,
    rtt_ms: float = 80.0,
    prompts: int = 8,
    context: int = 256,
    max_kv_gib: float = 1.0,
    head: int = 2,
    tail: int = 2,
    wire_dtype: str = "float16",
    batch_window_ms: float = 2.0,
    out: str = "results/load.json",
    progress: Progress = print,
) -> dict[str, Any]:
    torch.set_num_threads(1)
    kv_bound = int(max_kv_gib * (1 << 30))
    client = SplitClient(None, None, head, tail, wire_dtype, context, connection=ConnectionOptions(deadline_s=120.0))
    texts = [p.text for p in workload()][:prompts]
    prompt_ids = [client.encode_prompt(t) for t in texts]
    serve_args = [
        "--head", str(head), "--tail", str(tail), "--max-context", str(context), "--max-sessions", str(clients),
        "--max-kv-gib", str(max_kv_gib), "--threads", "1", "--batch-window-ms", str(batch_window_ms),
    ]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with ServerProcess(*serve_args, log_path=str(Path(out).with_suffix(".server.log"))) as server:
        watch = _Watch(server.port, server.proc.pid)
        rss_idle = watch.rss()
        progress(f"server up (RSS {rss_idle / 2**20:.0f} MiB); solo runs of {len(prompt_ids)} prompts")
        solo = [_decode(client, server.url, p, max_new_tokens, context, ClientRun(i)).ids for i, p in enumerate(prompt_ids)]
        netem = _Netem(server.port, rtt_ms)
        try:
            runs = [ClientRun(i % len(prompt_ids)) for i in range(clients)]
            start = threading.Barrier(clients + 1)

            def one(run: ClientRun) -> None:
                start.wait()
                try:
                    _decode(client, f"ws://127.0.0.1:{netem.port}", prompt_ids[run.prompt], max_new_tokens, context, run)
                except Exception as exc:  # reported, and counted as a failure
                    run.error = f"{type(exc).__name__}: {exc}"

            threads = [threading.Thread(target=one, args=(r,)) for r in runs]
            progress(f"{clients} clients x {max_new_tokens} tokens through netem at {rtt_ms:g} ms")
            with watch:
                for t in threads:
                    t.start()
                start.wait()
                t0 = time.perf_counter()
                for t in threads:
                    t.join()
                wall_s = time.perf_counter() - t0
        finally:
            netem.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
            metrics = r.read().decode()
    errors = [r.error for r in runs if r.error]
    correct = sum(r.error is None and r.ids == solo[r.prompt] for r in runs)
    decode_steps = [ms for r in runs for ms in r.step_ms[1:]]
    server_steps = [ms for r in runs for ms in r.server_ms[1:]]
    tokens = sum(len(r.ids) for r in runs)
    result = {
        "command": (
            f"splitllm bench load --clients {clients} --max-new-tokens {max_new_tokens} --rtt {rtt_ms:g} "
            f"--batch-window-ms {batch_window_ms:g}"
        ),
        "clients": clients,
        "batch_window_ms": batch_window_ms,
        "max_new_tokens": max_new_tokens,
        "rtt_ms": rtt_ms,
        "distinct_prompts": len(prompt_ids),
        "context": context,
        "correct_clients": correct,
        "errors": errors,
        "reconnects": sum(r.reconnects for r in runs),
        "wall_s": round(wall_s, 1),
        "aggregate_tokens_per_s": round(tokens / wall_s, 2),
        "per_client_tokens_per_s": round(tokens / wall_s / clients, 3),
        "step_ms": _percentiles(decode_steps) if decode_steps else {},
        "server_compute_ms": _percentiles(server_steps) if server_steps else {},
        "first_token_ms": _percentiles([r.step_ms[0] for r in runs if r.step_ms]),
        "kv_bytes_bound": kv_bound,
        "kv_bytes_peak": watch.peak_kv,
        "kv_within_bound": watch.peak_kv <= kv_bound,
        "sessions_peak": watch.peak_sessions,
        "server_rss_idle_mib": round(rss_idle / 2**20, 1),
        "server_rss_peak_mib": round(watch.peak_rss / 2**20, 1),
        "server_errors": [line for line in metrics.splitlines() if line.startswith("splitllm_errors_total")],
    }
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def summary(r: dict[str, Any]) -> str:
    return (
        f"{r['correct_clients']}/{r['clients']} clients identical to their solo runs, {len(r['errors'])} errors; "
        f"{r['aggregate_tokens_per_s']} tok/s aggregate over {r['wall_s']} s; step p50 {r['step_ms'].get('p50')} ms, "
        f"p99 {r['step_ms'].get('p99')} ms (server compute p50 {r['server_compute_ms'].get('p50')} ms, "
        f"p99 {r['server_compute_ms'].get('p99')} ms); KV peak {r['kv_bytes_peak'] / 2**20:.0f} MiB of "
        f"{r['kv_bytes_bound'] / 2**20:.0f} MiB bound; server RSS {r['server_rss_idle_mib']:.0f} -> "
        f"{r['server_rss_peak_mib']:.0f} MiB"
    )
