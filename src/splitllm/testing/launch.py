"""Start servers for demos, tests and benchmarks: in a thread (shares this process) or a subprocess."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType

import uvicorn

from splitllm.client.client import SplitClient
from splitllm.testing.netem import LinkProfile, ProxyThread
from splitllm.model.precision import Precision, fastest
from splitllm.server.app import MiddleServer
from splitllm.server.transport import TlsFiles, uvicorn_config
from splitllm.threads import ComputeThread, set_compute_threads


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, timeout: float, proc: subprocess.Popen | None = None) -> dict:
    """Poll /health until it answers; fail early if the server process died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before becoming healthy")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                return json.loads(r.read())
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"server on port {port} not healthy after {timeout:.0f} s")


class ServerThread:
    """A uvicorn server for a MiddleServer, run on a background thread of this process."""

    def __init__(self, server: MiddleServer, port: int | None = None, tls: TlsFiles | None = None) -> None:
        self.server = server
        self.port = port or free_port()
        self.tls = tls
        self._uvicorn = uvicorn.Server(uvicorn_config(server, "127.0.0.1", self.port, tls))
        self._thread = threading.Thread(target=self._uvicorn.run, daemon=True)

    @property
    def url(self) -> str:
        return f"{'wss' if self.tls else 'ws'}://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 30  # uvicorn's own flag: no HTTP probe, which mutual TLS would refuse
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server thread on port {self.port} did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(timeout=10)


@contextmanager
def serve_http(app: object) -> Iterator[str]:
    """An ASGI app served by uvicorn on a free loopback port, in a thread: yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))  # type: ignore[arg-type]
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def split_cores() -> tuple[set[int], set[int]]:
    """This process's cores in two halves (at least one each): a server's and a client's, so a benchmark
    on one machine gives each side cores of its own, as two machines would."""
    cores = sorted(os.sched_getaffinity(0))
    half = max(len(cores) // 2, 1)
    return set(cores[:half]), set(cores[half:] or cores)


CORE_LAYOUTS = ("halves", "alternate")


@dataclass(frozen=True)
class Sides:
    """The cores a one-machine benchmark gives its server and its client, and the threads each computes with."""

    server: set[int]
    client: set[int]
    threads: int
    layout: str


def sides(layout: str = "halves") -> Sides:
    """How a benchmark on one machine stands in for two.

    halves: each side pinned to half the cores with a thread per core (two machines of half this size;
    neither side ever waits for the other's cores). alternate: both sides on every core with a thread
    per core (two machines of this size). A split step's client and server compute in turn, each
    waiting for the other's message, so in `alternate` they share the cores without running at once.
    What sharing costs shows in the server's reported step time (`bench speed --model` compares it with in-process).
    """
    if layout not in CORE_LAYOUTS:
        raise ValueError(f"core layout must be one of {', '.join(CORE_LAYOUTS)}, not {layout!r}")
    server, client = split_cores()
    if layout == "alternate":
        server = client = server | client
    return Sides(server, client, len(server), layout)


def pinned(cores: set[int] | None) -> Callable[[], None] | None:
    """A `preexec_fn` that keeps a child process on `cores` (None: wherever this one may run)."""
    return None if cores is None else lambda: os.sched_setaffinity(0, cores)


@contextmanager
def on_cores(cores: set[int] | None) -> Iterator[None]:
    """This process on `cores` for the block (None: unchanged), then back where it was allowed to run."""
    before = os.sched_getaffinity(0)
    if cores is not None:
        os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


class ServerProcess:
    """`splitllm serve` in a child process, as a real deployment runs it; `cores`: the only cores it may use."""

    def __init__(
        self, *args: str, port: int | None = None, log_path: str | None = None, timeout: float = 300,
        cores: set[int] | None = None,
    ) -> None:
        self.port = port or free_port()
        self.args = [sys.executable, "-m", "splitllm.cli", "serve", "--port", str(self.port), *args]
        self.log_path, self.timeout, self.cores = log_path, timeout, cores
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerProcess:
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            self.args, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy(), preexec_fn=pinned(self.cores)
        )
        try:
            wait_healthy(self.port, self.timeout, self.proc)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class LinkedClient:
    """A client as `client-api` builds it (on its own compute thread), talking to a server subprocess."""

    client: SplitClient
    compute: ComputeThread
    precision: Precision


@contextmanager
def client_over_link(model: str, rtt_ms: float, core_layout: str) -> Iterator[LinkedClient]:
    """A server subprocess behind the WAN proxy at `rtt_ms` and a client of it in this process, each side
    on its own cores (`sides`), both at the fastest precision here; the block runs on the client's cores."""
    cores = sides(core_layout)
    set_compute_threads(cores.threads)
    precision = fastest()
    compute = ComputeThread()
    client = compute.run(lambda: SplitClient(model, wire_dtype="float16", precision=precision))
    serve = ("--model", model, "--threads", str(cores.threads), *precision.serve_args())
    with ServerProcess(*serve, cores=cores.server) as server, on_cores(cores.client):
        with ProxyThread("127.0.0.1", server.port, LinkProfile(rtt_ms=rtt_ms)) as proxy:
            client.server = f"ws://127.0.0.1:{proxy.port}"
            yield LinkedClient(client, compute, precision)
