"""WAN emulator tests over real loopback sockets: a threaded echo server behind a
ProxyThread. Wall-clock assertions are lower bounds (plus loose sanity bounds)
because the machines running them are noisy."""

from __future__ import annotations

import random
import signal
import socket
import socketserver
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from splitllm.testing.netem import LinkProfile, ProxyThread

TIMEOUT_S = 5.0


class _EchoHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        total = 0
        try:
            while data := self.request.recv(65536):
                total += len(data)
                self.request.sendall(data)
        except OSError:
            pass  # reset by the proxy: expected in the fault tests
        finally:
            self.server.received.append(total)  # type: ignore[attr-defined]


class _EchoServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _EchoHandler)
        self.received: list[int] = []  # bytes received, per finished connection


@pytest.fixture
def echo() -> Iterator[_EchoServer]:
    server = _EchoServer()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"EOF after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _recv_until_closed(sock: socket.socket) -> bytes:
    """Read until EOF or reset; a timeout (connection left open) fails the test."""
    buf = bytearray()
    try:
        while chunk := sock.recv(65536):
            buf += chunk
    except ConnectionResetError:
        pass
    return bytes(buf)


def _send_in_background(sock: socket.socket, payload: bytes, *, shutdown: bool) -> threading.Thread:
    """Send while the caller reads, so large echoes cannot deadlock on full buffers."""

    def send() -> None:
        sock.sendall(payload)
        if shutdown:
            sock.shutdown(socket.SHUT_WR)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def _median_rtt(port: int, rounds: int = 10) -> float:
    with _connect(port) as sock:
        sock.sendall(b"w")
        _recv_exact(sock, 1)  # warm-up: excludes connection setup
        samples = []
        for _ in range(rounds):
            start = time.perf_counter()
            sock.sendall(b"ping")
            _recv_exact(sock, 4)
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _echo_ok(port: int) -> bool:
    with _connect(port) as sock:
        sock.sendall(b"alive?")
        return _recv_exact(sock, 6) == b"alive?"


def _wait_for(predicate, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@pytest.mark.parametrize("size", [1, 1000, 65537, 1_000_000])
def test_transparent_echo_preserves_bytes_and_half_close(echo: _EchoServer, size: int) -> None:
    payload = random.Random(size).randbytes(size)
    with ProxyThread(*echo.server_address, LinkProfile()) as proxy, _connect(proxy.port) as sock:
        sender = _send_in_background(sock, payload, shutdown=True)
        # the client's half-close reaches the server, whose close comes back as EOF
        assert _recv_until_closed(sock) == payload
        sender.join(TIMEOUT_S)


def test_rtt_is_applied(echo: _EchoServer) -> None:
    base = _median_rtt(echo.server_address[1])
    with ProxyThread(*echo.server_address, LinkProfile(rtt_ms=100)) as proxy:
        proxied = _median_rtt(proxy.port)
    expected = 0.100 + base
    assert abs(proxied - expected) <= 0.1 * 0.100, f"median rtt {proxied * 1e3:.2f} ms, base {base * 1e3:.3f} ms"


def test_jitter_never_reorders_bytes(echo: _EchoServer) -> None:
    # jitter wider than the one-way delay: unclamped, later chunks would overtake
    messages = [i.to_bytes(4, "big") for i in range(150)]
    with ProxyThread(*echo.server_address, LinkProfile(rtt_ms=10, jitter_ms=30), seed=1) as proxy:
        with _connect(proxy.port) as sock:
            for msg in messages:
                sock.sendall(msg)  # separate sends -> separate chunks in the proxy
                time.sleep(0.001)
            assert _recv_exact(sock, 4 * len(messages)) == b"".join(messages)


def test_bandwidth_cap_adds_serialization_delay(echo: _EchoServer) -> None:
    size, mbit = 200_000, 8.0
    expected = size * 8 / (mbit * 1e6)  # 0.2 s; the echo path is pipelined, so ~1x one way
    payload = random.Random(0).randbytes(size)
    with ProxyThread(*echo.server_address, LinkProfile(bandwidth_mbit=mbit)) as proxy:
        with _connect(proxy.port) as sock:
            start = time.perf_counter()
            sender = _send_in_background(sock, payload, shutdown=False)
            assert _recv_exact(sock, size) == payload
            elapsed = time.perf_counter() - start
            sender.join(TIMEOUT_S)
    assert elapsed >= 0.8 * expected, f"{elapsed:.3f} s for {expected:.3f} s of serialization"
    # loose sanity bound: catches a bits/bytes (8x) mistake, not scheduling noise
    assert elapsed < 4 * expected + 0.5, f"{elapsed:.3f} s for {expected:.3f} s of serialization"


def test_fault_after_bytes_cuts_connection_and_proxy_survives(echo: _EchoServer) -> None:
    with ProxyThread(*echo.server_address, LinkProfile(fault_after_bytes=1000)) as proxy:
        with _connect(proxy.port) as sock:
            sock.sendall(b"a" * 600)
            assert _recv_exact(sock, 600) == b"a" * 600  # below the limit: untouched
            sock.sendall(b"b" * 600)  # crosses the limit at byte 1000
            assert len(_recv_until_closed(sock)) <= 400
        _wait_for(lambda: len(echo.received) == 1)
        assert 600 <= echo.received[0] <= 1000
        assert _echo_ok(proxy.port)  # a fresh connection still works


def test_drop_connections_cuts_live_connection_and_proxy_survives(echo: _EchoServer) -> None:
    with ProxyThread(*echo.server_address, LinkProfile(rtt_ms=10)) as proxy:
        with _connect(proxy.port) as sock:
            sock.sendall(b"hello")
            assert _recv_exact(sock, 5) == b"hello"  # connection is live end to end
            proxy.drop_connections()
            assert _recv_until_closed(sock) == b""
        _wait_for(lambda: len(echo.received) == 1)  # upstream side was cut too
        assert _echo_ok(proxy.port)


def test_close_with_open_connection_does_not_hang(echo: _EchoServer) -> None:
    proxy = ProxyThread(*echo.server_address, LinkProfile(rtt_ms=50))
    with _connect(proxy.port) as sock:
        sock.sendall(b"x")
        assert _recv_exact(sock, 1) == b"x"
        start = time.monotonic()
        proxy.close()
        assert time.monotonic() - start < TIMEOUT_S
        assert _recv_until_closed(sock) == b""
    proxy.close()  # idempotent


def test_unreachable_target_fails_only_that_connection() -> None:
    with socket.create_server(("127.0.0.1", 0)) as placeholder:
        dead_port = placeholder.getsockname()[1]  # closed on exit: nothing listens there
    with ProxyThread("127.0.0.1", dead_port, LinkProfile()) as proxy:
        for _ in range(2):  # the proxy survives the failure and handles the next one
            try:
                with _connect(proxy.port) as sock:
                    assert _recv_until_closed(sock) == b""
            except ConnectionResetError:
                pass  # the reset can even beat connect() returning on loopback


def test_run_netem_prints_banner_and_stops_on_sigterm(echo: _EchoServer) -> None:
    host, port = echo.server_address
    code = (
        "from splitllm.testing.netem import LinkProfile, run_netem; "
        f"run_netem('127.0.0.1', 0, '{host}:{port}', LinkProfile(rtt_ms=20, bandwidth_mbit=100))"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        banner = proc.stdout.readline()  # type: ignore[union-attr]
        assert banner.startswith("netem: listening on 127.0.0.1:")
        assert f"-> {host}:{port} (rtt=20 ms, jitter=0 ms, bandwidth=100 Mbit/s)" in banner
        listen_port = int(banner.split("127.0.0.1:")[1].split()[0])
        assert _echo_ok(listen_port)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(TIMEOUT_S) == 0
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]


def test_profile_validation() -> None:
    with pytest.raises(ValueError):
        LinkProfile(rtt_ms=-1)
    with pytest.raises(ValueError):
        LinkProfile(bandwidth_mbit=0)
    with pytest.raises(ValueError):
        LinkProfile(fault_after_bytes=0)
