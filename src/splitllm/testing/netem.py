"""User-space WAN emulator: an asyncio TCP proxy that adds latency, jitter and a
bandwidth cap, plus fault injection, so split-inference runs can be measured over
a "slow link" on machines where ``tc netem`` is not available.

Timing model (applied independently to each direction of each proxied connection,
so connections do not contend with each other):

* A chunk of ``B`` bytes read at time ``t`` starts serializing onto the link at
  ``start = max(t, link_free)`` and finishes at ``sent = start + B*8/bandwidth``
  (``sent = start`` without a cap); ``link_free`` becomes ``sent``. Queuing behind
  earlier chunks is what makes a bulk transfer take ``total_bytes*8/bandwidth``.
* It then propagates for ``rtt/2 + U(-jitter/2, +jitter/2)`` (floored at 0), and is
  released at ``max(sent + propagation, previous release)``: jitter may delay a
  chunk but never lets it overtake earlier bytes (TCP never reorders bytes).
* A writer task sleeps until each absolute release time (``loop.time()``), so
  scheduling error does not accumulate over many chunks. The event loop's 1 ms
  timer granularity makes each release slightly late (a loopback RTT measures a
  little above rtt; `bench sweep` reports each link's real RTT), which is below real
  WAN noise and not worth a CPU-burning spin.

EOF is a half-close that travels through the same delay line after the data
preceding it; the connection is torn down once both directions have ended, or at
once (both sockets reset) on any error, a fault, or :meth:`WanProxy.drop_connections`.
"""

from __future__ import annotations

import asyncio
import enum
import random
import signal
import socket
import struct
import threading
from contextlib import suppress
from dataclasses import dataclass

__all__ = ["LinkProfile", "WanProxy", "ProxyThread", "serve_forever", "run_netem"]

_READ_SIZE = 64 * 1024
# Bounded so a peer that stops reading back-pressures the sender (as real TCP would)
# instead of growing proxy memory without limit (<= 64 MiB per direction); large
# enough to bind only when a receiver really stalls, so arrival stamps stay honest.
_QUEUE_CHUNKS = 1024
_STOP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class LinkProfile:
    """Characteristics of the emulated link.

    rtt_ms: round-trip propagation delay; each direction adds ``rtt_ms / 2``.
    jitter_ms: peak-to-peak per-chunk variation of each one-way delay (uniform in
        ``[-jitter/2, +jitter/2]``), clamped so bytes are never reordered.
    bandwidth_mbit: per-direction capacity in Mbit/s (10**6 bit/s); ``None`` = unlimited.
    fault_after_bytes: if set, every connection is reset (both sides) right after
        this many client->server bytes have been delivered to the server.
    """

    rtt_ms: float = 0.0
    jitter_ms: float = 0.0
    bandwidth_mbit: float | None = None
    fault_after_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.rtt_ms < 0 or self.jitter_ms < 0:
            raise ValueError("rtt_ms and jitter_ms must be >= 0")
        if self.bandwidth_mbit is not None and self.bandwidth_mbit <= 0:
            raise ValueError("bandwidth_mbit must be > 0 (or None for unlimited)")
        if self.fault_after_bytes is not None and self.fault_after_bytes < 1:
            raise ValueError("fault_after_bytes must be >= 1 (or None)")

    def describe(self) -> str:
        """Human-readable summary for log lines."""
        bw = "unlimited" if self.bandwidth_mbit is None else f"{self.bandwidth_mbit:g} Mbit/s"
        text = f"rtt={self.rtt_ms:g} ms, jitter={self.jitter_ms:g} ms, bandwidth={bw}"
        if self.fault_after_bytes is not None:
            text += f", fault_after_bytes={self.fault_after_bytes}"
        return text


class _Signal(enum.Enum):
    EOF = enum.auto()  # source half-closed: half-close the destination
    CUT = enum.auto()  # fault_after_bytes reached: reset the connection


class _Cut(Exception):
    """Raised inside a connection to tear it down abruptly (fault injection)."""


class _LinkClock:
    """Release-time calculator for one direction of one connection (see module doc)."""

    def __init__(self, profile: LinkProfile, rng: random.Random) -> None:
        self._one_way_s = profile.rtt_ms / 2000.0
        self._jitter_s = profile.jitter_ms / 1000.0
        self._bit_rate = None if profile.bandwidth_mbit is None else profile.bandwidth_mbit * 1e6
        self._rng = rng
        self._link_free = 0.0
        self._last_release = 0.0

    def release_time(self, nbytes: int, arrival: float) -> float:
        sent = max(arrival, self._link_free)
        if self._bit_rate is not None:
            sent += nbytes * 8 / self._bit_rate
        self._link_free = sent
        delay = self._one_way_s
        if self._jitter_s:
            delay += self._rng.uniform(-self._jitter_s / 2, self._jitter_s / 2)
        release = max(sent + max(delay, 0.0), self._last_release)
        self._last_release = release
        return release


_Item = tuple[float, bytes | _Signal]  # (release time, payload)


async def _ingress(
    reader: asyncio.StreamReader,
    queue: asyncio.Queue[_Item],
    clock: _LinkClock,
    limit: int | None,
) -> None:
    """Read from one side, stamping each chunk with its release time on arrival."""
    loop = asyncio.get_running_loop()
    remaining = limit
    while True:
        data = await reader.read(_READ_SIZE)
        now = loop.time()
        if not data:
            await queue.put((clock.release_time(0, now), _Signal.EOF))
            return
        if remaining is not None:
            data = data[:remaining]
            remaining -= len(data)
        await queue.put((clock.release_time(len(data), now), data))
        if remaining == 0:
            await queue.put((clock.release_time(0, now), _Signal.CUT))
            return


async def _egress(queue: asyncio.Queue[_Item], writer: asyncio.StreamWriter) -> None:
    """Deliver queued chunks to the other side, each at its absolute release time."""
    loop = asyncio.get_running_loop()
    while True:
        release, item = await queue.get()
        delay = release - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if item is _Signal.EOF:
            if writer.can_write_eof():
                writer.write_eof()
            return
        if item is _Signal.CUT:
            raise _Cut
        writer.write(item)
        await writer.drain()


def _set_nodelay(writer: asyncio.StreamWriter) -> None:
    """Disable Nagle so the emulated delay is the only delay small messages see."""
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close abruptly with an RST, so the peer sees a failure rather than a clean
    end of stream it could mistake for a completed response."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class WanProxy:
    """TCP proxy applying a :class:`LinkProfile` between clients and one target."""

    def __init__(
        self,
        listen_host: str,
        listen_port: int,
        target_host: str,
        target_port: int,
        profile: LinkProfile,
        seed: int | None = None,
    ) -> None:
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.target_host = target_host
        self.target_port = target_port
        self.profile = profile
        self._rng = random.Random(seed)
        self._server: asyncio.Server | None = None
        self._closed = False
        # handler task -> the stream writers of its client and upstream sockets
        self._conns: dict[asyncio.Task[None], list[asyncio.StreamWriter]] = {}
        self._dropped: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        """The bound port (resolves ``listen_port=0``); only valid after start()."""
        if self._server is None:
            raise RuntimeError("proxy not started")
        return self._server.sockets[0].getsockname()[1]

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.listen_host, self.listen_port)

    async def stop(self) -> None:
        """Stop accepting, reset live connections and wait (bounded) for their tasks."""
        self._closed = True
        if self._server is not None:
            self._server.close()
        tasks = list(self._conns)
        self.drop_connections()
        if tasks:
            await asyncio.wait(tasks, timeout=_STOP_TIMEOUT_S)
        if self._server is not None:
            await self._server.wait_closed()

    def drop_connections(self) -> None:
        """Reset every currently proxied connection on both sides (event-loop thread only)."""
        for task, writers in list(self._conns.items()):
            for writer in writers:
                _reset(writer)
            self._dropped.add(task)
            task.cancel()

    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        if self._closed:
            _reset(cwriter)
            return
        task = asyncio.current_task()
        assert task is not None
        writers = [cwriter]
        self._conns[task] = writers
        clean = False
        try:
            try:
                await self._relay(creader, cwriter, writers)
                clean = True
            except* (OSError, _Cut):
                pass  # only this connection is over; the proxy keeps serving others
        except asyncio.CancelledError:
            if task not in self._dropped:
                raise
            # Dropped on purpose: end normally, since Python 3.11's start_server
            # logs a spurious error for a connection task that ends cancelled.
            task.uncancel()
        finally:
            self._dropped.discard(task)
            del self._conns[task]
            for writer in writers:
                if clean:
                    writer.close()
                else:
                    _reset(writer)

    async def _relay(
        self,
        creader: asyncio.StreamReader,
        cwriter: asyncio.StreamWriter,
        writers: list[asyncio.StreamWriter],
    ) -> None:
        """Connect upstream and pump both directions until both have seen EOF."""
        _set_nodelay(cwriter)
        sreader, swriter = await asyncio.open_connection(self.target_host, self.target_port)
        writers.append(swriter)
        _set_nodelay(swriter)
        async with asyncio.TaskGroup() as tg:
            self._start_direction(tg, creader, swriter, self.profile.fault_after_bytes)
            self._start_direction(tg, sreader, cwriter, None)

    def _start_direction(
        self,
        tg: asyncio.TaskGroup,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        limit: int | None,
    ) -> None:
        queue: asyncio.Queue[_Item] = asyncio.Queue(maxsize=_QUEUE_CHUNKS)
        clock = _LinkClock(self.profile, self._rng)
        tg.create_task(_ingress(reader, queue, clock, limit))
        tg.create_task(_egress(queue, writer))


class ProxyThread:
    """A :class:`WanProxy` running on its own event loop in a daemon thread, for
    synchronous code (tests, benchmarks). Construction returns once the port is
    bound; ``close()`` is idempotent and bounded in time."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        profile: LinkProfile = LinkProfile(),
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        seed: int | None = None,
    ) -> None:
        self._proxy = WanProxy(listen_host, listen_port, target_host, target_port, profile, seed)
        self.host = listen_host
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), name="netem-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(_STOP_TIMEOUT_S):
            self.close()
            raise RuntimeError("netem proxy did not start in time")
        if self._error is not None:
            self._thread.join(_STOP_TIMEOUT_S)
            raise self._error
        self.port = self._proxy.port

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            await self._proxy.start()
        except Exception as exc:  # re-raised in the constructing thread
            self._error = exc
            return
        finally:
            self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await self._proxy.stop()

    def drop_connections(self) -> None:
        """Reset all live proxied connections; returns once their sockets are closed."""
        assert self._loop is not None

        async def drop() -> None:
            self._proxy.drop_connections()

        asyncio.run_coroutine_threadsafe(drop(), self._loop).result(_STOP_TIMEOUT_S)

    def close(self) -> None:
        if self._loop is not None and self._stop is not None:
            with suppress(RuntimeError):  # loop already closed: thread has exited
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(_STOP_TIMEOUT_S)

    def __enter__(self) -> ProxyThread:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _split_target(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"target must be HOST:PORT, got {target!r}")
    return host.strip("[]"), int(port)


async def serve_forever(listen_host: str, listen_port: int, target: str, profile: LinkProfile) -> None:
    """Run a proxy until SIGINT/SIGTERM, printing one line once it is listening."""
    target_host, target_port = _split_target(target)
    proxy = WanProxy(listen_host, listen_port, target_host, target_port, profile)
    await proxy.start()
    print(f"netem: listening on {listen_host}:{proxy.port} -> {target} ({profile.describe()})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with suppress(NotImplementedError, RuntimeError, ValueError):  # non-main thread / non-Unix
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await proxy.stop()


def run_netem(listen_host: str, listen_port: int, target: str, profile: LinkProfile) -> None:
    """Blocking entry point for the ``splitllm netem`` CLI command."""
    with suppress(KeyboardInterrupt):  # where signal handlers could not be installed
        asyncio.run(serve_forever(listen_host, listen_port, target, profile))
