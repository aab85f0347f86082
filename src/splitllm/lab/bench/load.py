"""`splitllm bench load`: many concurrent clients, through the WAN proxy, against each kind of server.

Servers: one `splitllm serve` process per batching window, and a Ray Serve deployment per replica
count (`serve --engine ray`); each runs every client count in turn. Clients are threads of this
process sharing one ClientModel (each with its own SplitPipeline and server session), so N of them
cost one copy of the client's weights. The WAN emulator (`splitllm netem`) runs as its own process.

Clients either compute here ("real": every client's first and last stages and LM head on this
machine's few cores, so at 16+ clients they queue for CPU as no real deployment would), or run on emulated
devices ("device", the default): each replays the steps of its prompt's solo run, pausing for the
client compute that run measured, as a client on its own device would.

Checked: every real client's tokens equal its prompt's solo run (same server, nobody else connected),
every replayed reply equals the solo run's within float16 wire rounding;
the server's reserved KV bytes never exceed the bound it was started with (polled from /health,
with the server's resident memory; behind Ray, /health answers from whichever replica the proxy
picks, and the resident memory is not followed). Reported: per-step latency p50/p99 as clients
see it and as the server computes it, time to first token, aggregate tokens/s. EOS is ignored so
every client generates exactly the requested number of tokens.

With `prefill` (`bench load --prefill 4096`), it measures instead what one long prompt does to
everyone else: D decoding clients alone, then the same D while one more client sends a prompt of
`prefill` positions (cut by the client into steps of the server's `max_nodes`, interleaved by the
server's fair batches with the others' one-token steps). Reported: the decoders' step p50/p99 in
both runs and their ratio, the prefill's time, and whether every reply matched its solo run.
"""

from __future__ import annotations

import functools
import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


from splitllm.client.connection import ConnectionOptions
from splitllm.client.client import SplitClient
from splitllm.lab.bench.load_clients import Call, ClientRun, Solo, decode, replay, solo_runs
from splitllm.lab.bench.load_report import markdown, plot, prefill_markdown, scaling, summary
from splitllm.lab.data.workload import workload
from splitllm.options import BENCH_LOAD, GENERATE, Split, defaults_of, option
from splitllm.testing.launch import ServerProcess, free_port
from splitllm.threads import set_compute_threads

Progress = Callable[[str], None]


class _Netem:
    """`splitllm netem` in a child process."""

    def __init__(self, target_port: int, rtt_ms: float) -> None:
        self.port = free_port()
        args = [
            "netem", "--listen", f"127.0.0.1:{self.port}", "--target", f"127.0.0.1:{target_port}", "--rtt-ms",
            str(rtt_ms)
        ]
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

    def __init__(self, port: int, pid: int | None) -> None:
        self.port, self.pid = port, pid
        self.peak_kv = self.peak_sessions = self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        if self.pid is None:
            return 0
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


@dataclass(frozen=True)
class ServerKind:
    """A server to load: one process with a batching window, or Ray Serve replicas (window as given)."""

    batch_window_ms: float
    ray_replicas: int = 0  # 0: a plain `splitllm serve` process

    @property
    def label(self) -> str:
        batching = f"batching {self.batch_window_ms:g} ms" if self.batch_window_ms else "no batching"
        return f"ray x{self.ray_replicas}, {batching}" if self.ray_replicas else batching

    def args(self) -> list[str]:
        extra = ["--engine", "ray", "--replicas", str(self.ray_replicas)] if self.ray_replicas else []
        return ["--batch-window-ms", str(self.batch_window_ms), *extra]


_LOAD = defaults_of(BENCH_LOAD)


@dataclass(frozen=True, kw_only=True)
class LoadSettings:
    max_new_tokens: int = _LOAD["max_new_tokens"]
    rtt_ms: float = _LOAD["rtt_ms"]
    prompts: int = _LOAD["prompts"]
    context: int = _LOAD["max_context"]
    max_kv_gib: float = _LOAD["max_kv_gib"]
    first: int = Split.first
    last: int = Split.last
    wire_dtype: str = option(GENERATE, "wire_dtype").default
    # "device": each client replays its solo run's steps, its own compute a pause (as on its own
    # device); "real": every client computes here, all on this machine's cores.
    clients_compute: str = _LOAD["clients_compute"]


def _load_once(
    client: SplitClient, netem_port: int, prompt_ids: list[list[int]], solo: list[Solo],
    clients: int, s: LoadSettings, watch: _Watch,
) -> dict[str, Any]:
    """`clients` concurrent generations through the proxy; their latencies, speed and correctness."""
    runs = [ClientRun(i % len(prompt_ids)) for i in range(clients)]
    start = threading.Barrier(clients + 1)
    url = f"ws://127.0.0.1:{netem_port}"

    def one(run: ClientRun) -> None:
        start.wait()
        try:
            if s.clients_compute == "device":
                replay(client, url, solo[run.prompt].calls, s.context, run)
            else:
                decode(client, url, prompt_ids[run.prompt], s.max_new_tokens, s.context, run)
        except Exception as exc:  # reported, and counted as a failure
            run.error = f"{type(exc).__name__}: {exc}"

    def correct(run: ClientRun) -> bool:
        if run.error is not None:
            return False
        return run.matches_solo if s.clients_compute == "device" else run.ids == solo[run.prompt].ids

    threads = [threading.Thread(target=one, args=(r,)) for r in runs]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall_s = time.perf_counter() - t0
    decode_steps = [ms for r in runs for ms in r.step_ms[1:]]
    server_steps = [ms for r in runs for ms in r.server_ms[1:]]
    tokens = sum(len(r.step_ms) for r in runs)  # sequential decoding: one token a step
    return {
        "clients": clients,
        "correct_clients": sum(map(correct, runs)),
        "errors": [r.error for r in runs if r.error],
        "reconnects": sum(r.reconnects for r in runs),
        "wall_s": round(wall_s, 1),
        "aggregate_tokens_per_s": round(tokens / wall_s, 2),
        "per_client_tokens_per_s": round(tokens / wall_s / clients, 3),
        "step_ms": _percentiles(decode_steps) if decode_steps else {},
        "server_compute_ms": _percentiles(server_steps) if server_steps else {},
        "first_token_ms": _percentiles([r.step_ms[0] for r in runs if r.step_ms]),
        "kv_bytes_peak": watch.peak_kv,
        "sessions_peak": watch.peak_sessions,
        "server_rss_peak_mib": round(watch.peak_rss / 2**20, 1),
    }


def _load_server(
    client: SplitClient, kind: ServerKind, client_counts: list[int], prompt_ids: list[list[int]], s: LoadSettings,
    log_path: Path, progress: Progress,
) -> list[dict[str, Any]]:
    """Start one server of `kind`, take the solo runs, then each client count through the proxy."""
    serve_args = [
        "--first", str(s.first), "--last", str(s.last), "--max-context", str(s.context),
        "--max-sessions", str(max(client_counts)), "--max-kv-gib", str(s.max_kv_gib), "--threads", "1", *kind.args(),
    ]
    rows = []
    with ServerProcess(*serve_args, log_path=str(log_path)) as server:
        assert server.proc is not None
        pid = None if kind.ray_replicas else server.proc.pid  # behind Ray the replicas are other processes
        rss_idle = _Watch(server.port, pid).rss()
        progress(f"{kind.label}: server up; solo runs of {len(prompt_ids)} prompts")
        solo = solo_runs(client, server.url, prompt_ids, s.max_new_tokens, s.context)
        netem = _Netem(server.port, s.rtt_ms)
        try:
            for clients in client_counts:
                progress(
                    f"{kind.label}: {clients} {s.clients_compute} clients x {s.max_new_tokens} tokens "
                    f"at {s.rtt_ms:g} ms"
                )
                with _Watch(server.port, pid) as watch:
                    row = _load_once(client, netem.port, prompt_ids, solo, clients, s, watch)
                row |= {
                    "server": kind.label, "batch_window_ms": kind.batch_window_ms, "ray_replicas": kind.ray_replicas,
                    "clients_compute": s.clients_compute,
                    "server_rss_idle_mib": round(rss_idle / 2**20, 1),
                }
                progress("  " + summary(row))
                rows.append(row)
        finally:
            netem.close()
    return rows


def _client_and_prompts(s: LoadSettings, context: int) -> tuple[SplitClient, list[list[int]]]:
    """The client model every load client shares (holding `context` positions) and the prompts' ids."""
    client = SplitClient(
        None, None, s.first, s.last, s.wire_dtype, context, connection=ConnectionOptions(deadline_s=120.0)
    )
    return client, [client.encode_prompt(p.text) for p in workload()][: s.prompts]


def run_load(
    client_counts: list[int],
    kinds: list[ServerKind],
    settings: LoadSettings = LoadSettings(),
    out: str = "results/load",
    command: str = "splitllm bench load",
    progress: Progress = print,
) -> dict[str, Any]:
    """Every server kind at every client count; writes load.json, load.md and load.png into `out`."""
    set_compute_threads(1)
    s = settings
    client, prompt_ids = _client_and_prompts(s, s.context)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, kind in enumerate(kinds):
        rows += _load_server(client, kind, client_counts, prompt_ids, s, folder / f"server-{i}.log", progress)
    kv_bound = int(s.max_kv_gib * (1 << 30))
    result = {
        "command": command,
        "settings": asdict(s),
        "kv_bytes_bound": kv_bound,
        "kv_within_bound": all(r["kv_bytes_peak"] <= kv_bound for r in rows),
        "rows": rows,
        "scaling": scaling(rows),
    }
    (folder / "load.json").write_text(json.dumps(result, indent=2) + "\n")
    (folder / "load.md").write_text(markdown(result))
    plot(rows, folder / "load.png")
    return result


def _long_prompt(prompt_ids: list[list[int]], length: int) -> list[int]:
    """`length` token ids: the workload prompts one after another, repeated as needed."""
    ids: list[int] = []
    while len(ids) < length:
        ids += [i for p in prompt_ids for i in p]
    return ids[:length]


def run_prefill(
    decoders: int,
    prefill: int,
    settings: LoadSettings = LoadSettings(),
    batch_window_ms: float = 2.0,
    serve_args: Sequence[str] = (),
    out: str = "results/load",
    command: str = "splitllm bench load --prefill",
    progress: Progress = print,
) -> dict[str, Any]:
    """Decoders' step latency without and with one long prefill arriving among them; writes
    prefill.json and prefill.md into `out`."""
    set_compute_threads(1)
    s = settings
    long_context = prefill + s.max_new_tokens + 8
    client, prompt_ids = _client_and_prompts(s, long_context)
    long_ids = _long_prompt(prompt_ids, prefill)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    args = [
        "--first", str(s.first), "--last", str(s.last), "--max-context", str(long_context),
        "--max-sessions", str(decoders + 1), "--max-kv-gib", str(s.max_kv_gib), "--threads", "1",
        "--batch-window-ms", str(batch_window_ms), *serve_args,
    ]
    with ServerProcess(*args, log_path=str(folder / "prefill-server.log")) as server:
        progress(f"server up; solo runs of {len(prompt_ids)} prompts and of the {prefill}-position prompt")
        solo = solo_runs(client, server.url, prompt_ids, s.max_new_tokens, s.context)
        long_run, long_calls = decode(client, server.url, long_ids, 2, long_context, ClientRun(-1), record=True)
        pid = server.proc.pid if server.proc else None
        netem = _Netem(server.port, s.rtt_ms)
        load = functools.partial(_load_once, client, netem.port, prompt_ids, solo, decoders, s)
        try:
            progress(f"{decoders} decoders alone")
            with _Watch(server.port, pid) as watch:
                alone = load(watch)
            progress("  " + summary(alone))
            progress(f"{decoders} decoders and one {prefill}-position prefill")
            delay_s = 2 * s.rtt_ms / 1000 + 0.5  # land among the decoders' steps, not before them
            with _long_prefill(client, netem.port, long_calls[:1], long_context, delay_s) as prefill_run:
                with _Watch(server.port, pid) as watch:
                    disturbed = load(watch)
            progress("  " + summary(disturbed))
        finally:
            netem.close()
    result = {
        "command": command,
        "settings": asdict(s) | {"batch_window_ms": batch_window_ms, "serve_args": list(serve_args)},
        "decoders": decoders,
        "prefill_positions": prefill,
        "prefill_ms": round(prefill_run.step_ms[0], 1) if prefill_run.step_ms else None,
        "prefill_ok": prefill_run.error is None and prefill_run.matches_solo and bool(long_run.ids),
        "prefill_error": prefill_run.error,
        "alone": alone,
        "with_prefill": disturbed,
        "p99_ratio": round(disturbed["step_ms"]["p99"] / alone["step_ms"]["p99"], 2),
        "p50_ratio": round(disturbed["step_ms"]["p50"] / alone["step_ms"]["p50"], 2),
    }
    (folder / "prefill.json").write_text(json.dumps(result, indent=2) + "\n")
    (folder / "prefill.md").write_text(prefill_markdown(result))
    return result


@contextmanager
def _long_prefill(
    client: SplitClient, netem_port: int, calls: list[Call], context: int, delay_s: float
) -> Iterator[ClientRun]:
    """One more client, in its own thread, sending the long prompt's steps after `delay_s`; its run (the
    prefill's time as its one step) once the block is done."""
    run = ClientRun(-1)

    def send() -> None:
        time.sleep(delay_s)
        t0 = time.perf_counter()
        try:
            replay(client, f"ws://127.0.0.1:{netem_port}", calls, context, run)
        except Exception as exc:  # reported, and counted as a failure
            run.error = f"{type(exc).__name__}: {exc}"
        run.step_ms = [(time.perf_counter() - t0) * 1000]

    thread = threading.Thread(target=send)
    thread.start()
    try:
        yield run
    finally:
        thread.join()

