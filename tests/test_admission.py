"""Nothing before authentication hurts the server; connection caps, fair batches, shared-forward faults.

Everything runs over real sockets on loopback. Hostile loops are bounded in bytes and in time.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import select
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from conftest import TINY_SPLIT
from protocol_client import greedy
from websockets.exceptions import ConnectionClosed

from splitllm.client.connection import ConnectionOptions, is_transient
from splitllm.client.remote import RemoteMiddle
from splitllm.testing.launch import ServerProcess, ServerThread
from splitllm.server.app import MiddleServer
from splitllm.server.auth import TokenTable
from splitllm.server.settings import ServerSettings

FIRST, LAST = TINY_SPLIT
TOKENS = {name: secrets.token_urlsafe(24) for name in ("alice", "bob", "ops")}


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "tokens"
    path.write_text("".join(f"{p}:{t}\n" for p, t in TOKENS.items()))
    return path


@pytest.fixture(scope="module")
def expected(tiny, load_client_model, pipeline, random_ids):  # type: ignore[no-untyped-def]
    """prompt -> greedy ids of the unsplit-in-process pipeline, for exactness checks."""
    client_model = load_client_model(tiny, FIRST, LAST)
    return lambda seed: (random_ids(6, seed),
                         greedy(client_model, pipeline(tiny, FIRST, LAST, 64).middle, random_ids(6, seed), 10))


def _remote(url: str, files, principal: str | None, **options) -> RemoteMiddle:  # type: ignore[no-untyped-def]
    opts = ConnectionOptions(token=TOKENS[principal] if principal else None, **{"deadline_s": 10.0, **options})
    return RemoteMiddle(url, files.fingerprint, (FIRST, files.config.num_layers - LAST), "float32", 64, opts)


def _generate(url: str, client_model, principal: str | None,  # type: ignore[no-untyped-def]
              prompt: list[int]) -> list[int]:
    return greedy(client_model, _remote(url, client_model.files, principal), prompt, 10)


def _health(port: int, principal: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {TOKENS[principal]}"} if principal else {}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/health", headers=headers)
    with urllib.request.urlopen(request, timeout=5) as r:
        assert r.status == 200
        return json.loads(r.read())


# --- before authentication ------------------------------------------------------------------------------


def _flood(port: int, budget: int, long_lines: bool, deadline: float) -> tuple[int, float]:
    """Send request heads that never end until `budget` bytes went out; (bytes sent, longest connection life)."""
    line = b"X-" + b"a" * 60_000 + b"\r\n" if long_lines else b"X-a: b\r\n" * 8_000
    sent, longest = 0, 0.0
    while sent < budget and time.monotonic() < deadline:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            opened = time.monotonic()
            sock.sendall(b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n")
            while sent < budget and time.monotonic() < deadline:
                try:
                    sock.sendall(line)
                except OSError:
                    break
                sent += len(line)
                if select.select([sock], [], [], 0)[0]:  # the server answered (431/400) and hangs up
                    break
            with_answer = select.select([sock], [], [], 5)[0]
            assert with_answer, "the server kept a flooding connection open"
            longest = max(longest, time.monotonic() - opened)
    return sent, longest


def _rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


@pytest.mark.slow  # a server process and seconds of timeouts
def test_header_flood_and_slowloris_cost_the_server_nothing(  # type: ignore[no-untyped-def]
    tiny, token_file, load_client_model, expected
) -> None:
    """100 MB of never-ending request heads from 10 unauthenticated connections (reconnecting when
    cut off), plus 10 slowloris connections: RSS grows < 20 MiB, every one is closed within the
    handshake timeout, and an authenticated client keeps its exact output meanwhile."""
    client_model = load_client_model(tiny, FIRST, LAST)
    prompt, want = expected(1)
    timeout = 2.0
    args = ["--model", tiny, "--first", str(FIRST), "--last", str(LAST), "--exact", "--threads", "1",
            "--auth-token-file", str(token_file),
            "--handshake-timeout-s", str(timeout)]
    with ServerProcess(*args, timeout=120) as server:
        assert _generate(server.url, client_model, "alice", prompt) == want  # warm: first-step allocations done
        before = _rss(server.proc.pid)  # type: ignore[union-attr]
        deadline = time.monotonic() + 120
        slow_lives: list[float] = []

        def slowloris() -> None:
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                opened = time.monotonic()
                sock.sendall(b"GET /ws HTTP/1.1\r\n")
                try:
                    for _ in range(int(4 * timeout / 0.2)):
                        sock.sendall(b"X-slow: 1\r\n")
                        if select.select([sock], [], [], 0.2)[0] and not sock.recv(4096):
                            break
                except OSError:
                    pass
                slow_lives.append(time.monotonic() - opened)

        with ThreadPoolExecutor(20) as pool:
            slow = [pool.submit(slowloris) for _ in range(10)]
            floods = [pool.submit(_flood, server.port, 10 << 20, i % 2 == 0, deadline) for i in range(10)]
            during = _generate(server.url, client_model, "alice", prompt)
            results = [f.result() for f in floods]
            for f in slow:
                f.result()
        grown = _rss(server.proc.pid) - before  # type: ignore[union-attr]
        print(f"flood: {sum(sent for sent, _ in results) / 2**20:.0f} MiB sent, RSS grew {grown / 2**20:.1f} MiB, "
              f"longest flood connection {max(life for _, life in results):.2f} s, slowloris closed after "
              f"{min(slow_lives):.2f}-{max(slow_lives):.2f} s")
        assert sum(sent for sent, _ in results) >= 100 << 20
        assert max(life for _, life in results) < timeout
        assert len(slow_lives) == 10 and max(slow_lives) < timeout + 1.0
        assert grown < 20 << 20, f"RSS grew {grown / 2**20:.1f} MiB"
        assert during == want
        assert _generate(server.url, client_model, "alice", prompt) == want


def _exchange(port: int, data: bytes, wait_s: float = 5.0) -> bytes:
    """Send `data`, then read until the server closes (or `wait_s` passes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
        sock.sendall(data)
        chunks = []
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks)


def test_request_heads_are_bounded_in_bytes_lines_and_time(tiny) -> None:  # type: ignore[no-untyped-def]
    server = MiddleServer(tiny, ServerSettings(first=FIRST, last=LAST, handshake_timeout_s=1.0, max_header_lines=8))
    with ServerThread(server) as thread:
        ok = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(7)) + b"\r\n"
        assert _exchange(thread.port, ok, 3.0).startswith(b"HTTP/1.1 200")  # 8 headers: within the cap
        too_many = ok.replace(b"\r\n\r\n", b"\r\nX-9: 1\r\n\r\n")
        assert _exchange(thread.port, too_many).startswith(b"HTTP/1.1 431")
        too_big = b"GET /health HTTP/1.1\r\nX-big: " + b"a" * (32 << 10) + b"\r\n\r\n"
        assert _exchange(thread.port, too_big).startswith(b"HTTP/1.1 400")
        started = time.monotonic()
        assert _exchange(thread.port, b"GET /health HTTP/1.1\r\n").startswith(b"HTTP/1.1 408")
        assert time.monotonic() - started < 3.0
        # a kept-alive connection: two requests, then the same deadline for a third head
        started = time.monotonic()
        replies = _exchange(thread.port, ok + ok)
        assert replies.count(b"HTTP/1.1 200") == 2 and time.monotonic() - started < 10.0


def test_thousand_idle_sockets_leave_health_and_clients_alone(  # type: ignore[no-untyped-def]
    tiny, token_file, load_client_model, expected
) -> None:
    client_model = load_client_model(tiny, FIRST, LAST)
    prompt, want = expected(2)
    server = MiddleServer(tiny, ServerSettings(first=FIRST, last=LAST, handshake_timeout_s=60.0),
                          TokenTable.load(token_file))
    sockets: list[socket.socket] = []
    with ServerThread(server) as thread:
        try:
            for _ in range(1000):
                sock = socket.create_connection(("127.0.0.1", thread.port), timeout=5)
                sock.sendall(b"GET /ws HTTP/1.1\r\nHost: x\r\n")  # half a request head, never finished
                sockets.append(sock)
            assert _health(thread.port)["status"] == "ok"
            assert _generate(thread.url, client_model, "bob", prompt) == want
        finally:
            for sock in sockets:
                sock.close()


# --- admission ------------------------------------------------------------------------------------------


def _refusal(url: str, principal: str) -> str:
    """How the server answers a new connection: 'admitted', or the close code and reason it ends it with."""
    ws = ConnectionOptions(token=TOKENS[principal]).connect(url + "/ws")
    try:
        ws.recv(timeout=5)
    except ConnectionClosed as exc:
        assert is_transient(exc)  # the client retries it
        return f"{exc.rcvd.code} {exc.rcvd.reason}" if exc.rcvd else "closed"
    except TimeoutError:
        return "admitted"
    finally:
        ws.close()
    return "admitted"


def test_connection_caps_count_websockets_and_spare_health(tiny, token_file) -> None:  # type: ignore[no-untyped-def]
    settings = ServerSettings(first=FIRST, last=LAST, max_connections=4, max_connections_per_principal=3,
                              operators=("ops",))
    server = MiddleServer(tiny, settings, TokenTable.load(token_file))
    with ServerThread(server) as thread:
        alice = [_remote(thread.url, server.files, "alice") for _ in range(3)]
        assert _refusal(thread.url, "alice").startswith("1013 at most 3 connections per principal")
        bob = _remote(thread.url, server.files, "bob")
        assert _refusal(thread.url, "bob").startswith("1013 server holds its maximum of 4")
        assert _health(thread.port)["status"] == "ok"  # never capped
        assert _health(thread.port, "ops")["connections"] == 4
        assert _health(thread.port, "bob")["sessions"] == 1  # bob sees his own load only
        alice.pop().close()
        time.sleep(0.2)
        second = _remote(thread.url, server.files, "bob")
        for middle in (*alice, bob, second):
            middle.close()
        assert server.metrics.total("splitllm_handshakes_refused_total", reason="principal_busy") == 1
        assert server.metrics.total("splitllm_handshakes_refused_total", reason="server_busy") == 1


def test_sessions_per_principal_have_a_default_cap_with_tokens(tiny,  # type: ignore[no-untyped-def]
                                                               token_file) -> None:
    server = MiddleServer(tiny, ServerSettings(first=FIRST, last=LAST, max_sessions=8), TokenTable.load(token_file))
    with ServerThread(server) as thread:
        held = [_remote(thread.url, server.files, "alice") for _ in range(2)]
        with pytest.raises(Exception, match="principal_full|no splitllm server answered"):
            _remote(thread.url, server.files, "alice", deadline_s=0.3)
        held.append(_remote(thread.url, server.files, "bob"))
        for middle in held:
            middle.close()


# --- shared forwards ------------------------------------------------------------------------------------


def test_failed_shared_forward_retries_bystanders_alone(  # type: ignore[no-untyped-def]
    tiny, load_client_model, expected, monkeypatch
) -> None:
    """Every shared forward fails, and one session's steps always fail: the others finish exactly, and
    the failing one, told to retry, finishes in a new session."""
    client_model = load_client_model(tiny, FIRST, LAST)
    server = MiddleServer(tiny, ServerSettings(first=FIRST, last=LAST, batch_window_ms=30.0))
    original, shared = server.stage.forward_many, []
    poisoned: set[int] = set()

    def faulty(steps):  # type: ignore[no-untyped-def]
        if len(steps) > 1:
            shared.append(len(steps))
            raise RuntimeError("fault injected into a shared forward")
        if id(steps[0][0]) in poisoned:  # its (cache, step)
            raise RuntimeError("fault injected into one session's step")
        return original(steps)

    monkeypatch.setattr(server.stage, "forward_many", faulty)
    with ServerThread(server) as thread:
        culprit = _remote(thread.url, server.files, None)
        poisoned.add(id(server.sessions._sessions[culprit.session].cache))
        barrier = threading.Barrier(5)

        def bystander(seed: int) -> list[int]:
            barrier.wait()
            return _generate(thread.url, client_model, None, expected(seed)[0])

        def doomed() -> tuple[list[int], int]:
            """Its step fails alone too, retryably: it reconnects into a new session (a fresh cache)."""
            barrier.wait()
            ids = greedy(client_model, culprit, expected(9)[0], 10)
            return ids, culprit.reconnects

        with ThreadPoolExecutor(5) as pool:
            runs = {seed: pool.submit(bystander, seed) for seed in range(4)}
            code = pool.submit(doomed)
            assert {seed: run.result() for seed, run in runs.items()} == {seed: expected(seed)[1] for seed in range(4)}
            assert code.result()[0] == expected(9)[1] and code.result()[1] >= 1
    assert shared, "no steps shared a forward"
