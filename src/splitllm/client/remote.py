"""The server's middle layers seen from the client: one WebSocket session, one round trip a step.

The link may fail at any step (a dropped connection, a restarted server, an expired session). The
middle keeps the hidden states it sent for every committed entry, applying each step's `keep` to
that record exactly as the caches do, so it can open a new session (on the same or a fallback
server), replay them as a chain prefill, and resend the step: the caller sees one slow step and an
output identical to an uninterrupted run.

A step longer than the server's announced `max_nodes` (a long prompt) goes as several steps, cut
only where every later position sees every earlier one (a chain prefix): each part commits the
one before it, so the server computes exactly what one step would have.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import TypeVar, cast

import torch
from websockets.sync.client import ClientConnection

from splitllm.options import GENERATE, SERVE, option
from splitllm.protocol import messages, wire
from splitllm.protocol.messages import (
    PROTOCOL_VERSION, CloseMessage, ClosedMessage, ErrorMessage, OpenedMessage, OpenMessage, Reply, ResultMessage,
    StepMessage,
)
from splitllm.attestation.handshake import ClientHandshake, Evidence
from splitllm.attestation.sealing import SealedChannel
from splitllm.attestation.verify import AttestationError
from splitllm.client.connection import ConnectionOptions, ServerError, ServerUnreachable, describe, is_transient
from splitllm.stats import StepTiming
from splitllm.model.stage import Step
from splitllm.model.visibility import Visibility

__all__ = ["RemoteMiddle", "ServerError"]

_JITTER = secrets.SystemRandom()  # the OS's randomness: leaves the random module's state to the caller
_BACKOFF_S = (0.05, 2.0)  # first and largest pause between rounds of connection attempts

log = logging.getLogger("splitllm.client")
_R = TypeVar("_R", OpenedMessage, ResultMessage, ClosedMessage)


def _ws_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/ws") else url + "/ws"


class _SentRecord:
    """The hidden states (and positions) sent for committed entries, plus the last step's, pending."""

    def __init__(self) -> None:
        self._hidden: list[torch.Tensor] = []
        self._positions: list[torch.Tensor] = []
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def keep(self, keep: Sequence[int]) -> None:
        """Commit the chosen entries of the last step, in order, as KVCache.keep does."""
        if self._pending is not None and len(keep):
            index = torch.tensor(list(keep), dtype=torch.long)
            self._hidden.append(self._pending[0].index_select(0, index))
            self._positions.append(self._pending[1].index_select(0, index))
        self._pending = None

    def push(self, hidden: torch.Tensor, positions: torch.Tensor) -> None:
        self._pending = (hidden, positions)

    def crop(self, length: int) -> None:
        """Forget every entry from `length` on, as KVCache.crop does."""
        record = self.committed()
        if record is not None:
            self._hidden, self._positions = [record[0][:length]], [record[1][:length]]
        self._pending = None

    def committed(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self._hidden:
            return None
        if len(self._hidden) > 1:  # consolidate, so each replay concatenates only what came since
            self._hidden, self._positions = [torch.cat(self._hidden)], [torch.cat(self._positions)]
        return self._hidden[0], self._positions[0]


class RemoteMiddle:
    """A session on a splitllm server holding layers [start, end) and their KV cache."""

    overlaps = True  # the server computes while the client's core is free

    def __init__(
        self,
        url: str,
        fingerprint: str,
        layers: tuple[int, int],
        wire_dtype: str = option(GENERATE, "wire_dtype").default,
        max_context: int = option(SERVE, "max_context").default,
        options: ConnectionOptions | None = None,
    ) -> None:
        if wire_dtype not in wire.WIRE_DTYPES:
            raise ValueError(f"wire dtype must be one of {', '.join(wire.WIRE_DTYPES)}")
        self.options = options or ConnectionOptions()
        self.urls = [_ws_url(u) for u in (url, *self.options.fallbacks)]
        self.url = self.urls[0]
        self.wire_dtype = wire_dtype
        self.reconnects = 0
        self._open_request = OpenMessage(fingerprint, (layers[0], layers[1]), wire_dtype, max_context)
        self._ids = itertools.count(1)
        self._ws: ClientConnection | None = None
        self._channel: SealedChannel | None = None  # set on an attested connection: every frame is sealed
        self._record = _SentRecord()
        self._resume_keep: list[int] = []
        self._committed = 0  # leading entries of the last step its earlier parts already committed
        self._ahead: tuple[Step, ClientConnection | None] | None = None  # a step sent ahead, and on which connection
        self._in_flight_whole = False  # whether the request in flight is a whole step (its last part)
        self._drain = 0  # replies still to come for steps sent ahead and dropped, read and discarded
        self._rebuild = False  # the server missed a step the record counts: open a new session and replay
        self._connect(time.monotonic() + self.options.deadline_s)

    def _sealed(self, message: bytes) -> bytes:
        return self._channel.seal(message) if self._channel is not None else message

    def _opened(self, message: bytes) -> bytes:
        """A received message as a plain frame; SealError if an attested connection's message is refused."""
        return self._channel.open(message) if self._channel is not None else message

    def _exchange(self, message: bytes, timeout: float | None = None) -> bytes:
        """Send one frame; the plain frame of its reply."""
        assert self._ws is not None
        self._ws.send(self._sealed(message))
        return self._opened(cast(bytes, self._ws.recv(timeout=timeout or self.options.step_timeout_s)))  # binary frames

    def _call(self, request: OpenMessage | StepMessage | CloseMessage, kind: type[_R],
              timeout: float | None = None) -> _R:
        """The reply to `request`, of `kind`; ServerError if the server refused it."""
        return _expect(messages.decode(self._exchange(messages.encode(request), timeout), messages.REPLIES), kind)

    def _step_message(self, step: Step) -> StepMessage:
        """The request of a step whose inputs are already in the wire dtype."""
        parents, bits = step.vis.to_wire()
        positions = tuple(step.positions.tolist())
        return StepMessage(
            self.session, step.inputs, self.wire_dtype, positions, tuple(step.keep), parents, bits, next(self._ids),
            step.crop,
        )

    def _attest(self) -> None:
        """Verify the server against the policy and seal the connection; AttestationError, with nothing
        sent but the nonce and a public key, if any check fails."""
        policy = self.options.attestation
        self._channel = None
        if policy is None:
            return
        handshake = ClientHandshake(policy, self._open_request.fingerprint, self._open_request.layers, PROTOCOL_VERSION)
        # The handshake's messages are attestation.handshake's header maps, framed as they are.
        frame = wire.decode(self._exchange(wire.encode(handshake.request(next(self._ids))),
                                           self.options.open_timeout_s))
        if frame.header["op"] == ErrorMessage.OP:
            error = _refusal(messages.parse(frame, (ErrorMessage,)))
            if error.code in ("attestation_unavailable", "unknown_op"):
                raise AttestationError("evidence", f"{self.url} offers no attestation evidence ({error})")
            raise error
        if frame.header["op"] != "evidence":
            raise AttestationError("evidence", f"{self.url} answered {frame.header['op']!r} to attest")
        evidence = Evidence.from_header(frame.header)
        self._channel, verified = handshake.finish(evidence)
        log.info("%s attested: %s %s, measurement %s%s", self.url, evidence.platform, verified.product,
                 verified.report.measurement.hex()[:16], " (simulated vendor)" if verified.simulated else "")

    def _connect(self, deadline: float) -> None:
        """Open a session, trying each server in turn with growing pauses, and replay what is committed."""
        pause = _BACKOFF_S[0]
        for attempt in itertools.count():
            url = self.urls[attempt % len(self.urls)]
            try:
                self._ws = self.options.connect(url)
                self.url = url
                self._attest()
                opened = self._call(replace(self._open_request, id=next(self._ids)), OpenedMessage)
                self.session: str = opened.session
                self.max_context: int = opened.max_context
                self.max_nodes: int = opened.max_nodes
                self.row_invariant: bool = opened.row_invariant
                self._replay()
                return
            except Exception as exc:
                self._drop()
                if not is_transient(exc):
                    raise
                round_done = attempt % len(self.urls) == len(self.urls) - 1
                if round_done and time.monotonic() + pause > deadline:
                    raise self._unreachable(exc) from exc
                if round_done and attempt < len(self.urls):  # said once, so a silent wait is never a hang
                    log.warning("no splitllm server answered (tried %s; last error: %s); trying again for up to %.0f s "
                                "(--reconnect-deadline-s)", ", ".join(self.urls), describe(exc),
                                deadline - time.monotonic())
            if round_done:  # every server failed once: pause before the next round
                time.sleep(pause * _JITTER.uniform(0.5, 1.0))
                pause = min(pause * 2, _BACKOFF_S[1])

    def _unreachable(self, exc: BaseException) -> ServerUnreachable:
        return ServerUnreachable(
            f"no splitllm server answered within {self.options.deadline_s:g} s "
            f"(tried {', '.join(self.urls)}); last error: {describe(exc)}"
        )

    def _replay(self) -> None:
        """Rebuild the new session's cache from the record: chain prefill steps, the last one left pending."""
        self._resume_keep = []
        self._committed = 0
        self._drain, self._rebuild = 0, False
        record = self._record.committed()
        if record is None:
            return
        hidden, positions = record
        for start in range(0, hidden.shape[0], self.max_nodes):
            chunk = hidden[start : start + self.max_nodes]
            n = chunk.shape[0]
            part = Step(chunk, positions[start : start + n], Visibility.chain(n), self._resume_keep)
            self._call(self._step_message(part), ResultMessage)
            self._resume_keep = list(range(n))

    def _drop(self) -> None:
        if self._ws is not None:
            try:
                self._ws.close()
            except Exception:
                pass  # the link is already broken; nothing to tell the server
            self._ws = None

    def step(self, step: Step, timing: StepTiming, while_waiting: Iterator[object] | None = None) -> torch.Tensor:
        """Send hidden states after the first stage, get them back before the last stage; fills the wire timings.
        A piece of `while_waiting` runs after each request is sent (a retry goes on with the next piece)."""
        sent = self._on_wire(step)
        if step.crop is not None:
            self._record.crop(step.crop)
        self._record.keep(step.keep)
        server_keep = [] if step.crop is not None else self._server_keep(step.keep)
        return self._deliver(sent, server_keep, timing, while_waiting, awaiting=False)

    def _on_wire(self, step: Step) -> Step:
        return step.with_inputs(step.inputs.detach().to(wire.WIRE_DTYPES[self.wire_dtype]).contiguous())

    def _deliver(
        self, sent: Step, server_keep: list[int] | None, timing: StepTiming, while_waiting: Iterator[object] | None,
        awaiting: bool,
    ) -> torch.Tensor:
        """The middle's outputs for a step already in the record: sent now (or, `awaiting`, sent ahead
        earlier), and sent again into a new session as long as the link keeps failing."""
        waiting = while_waiting if while_waiting is not None else iter(())
        deadline = None
        while True:
            try:
                if server_keep is None or self._rebuild:  # the server's entries differ from the record's
                    raise ConnectionResetError("the session's committed entries differ from the client's")
                if awaiting:
                    parts = [self._receive(sent, time.perf_counter(), timing, waiting, whole=True)]
                    self._committed = 0
                else:
                    parts = [
                        self._send_part(sent, start, end, part_keep, timing, waiting)
                        for start, end, part_keep in self._keeps(sent.vis.cuts(self.max_nodes), server_keep)
                    ]
                break
            except Exception as exc:
                if not is_transient(exc):
                    raise
                deadline = deadline or time.monotonic() + self.options.deadline_s
                if time.monotonic() > deadline:  # reconnecting works, but this step never gets through
                    raise self._unreachable(exc) from exc
                self.reconnects += 1
                log.warning("link to %s failed (%s); reconnecting", self.url, describe(exc))
                self._drop()
                self._connect(deadline)
                server_keep, awaiting = self._resume_keep, False
                sent = replace(sent, crop=None)  # the replay holds the record, cropped already
        self._record.push(sent.inputs, sent.positions.clone())
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    @property
    def ahead_ready(self) -> bool:
        """Whether a step may go ahead now: one whole step in flight, none ahead yet."""
        return self._ahead is None and self._in_flight_whole and self._ws is not None

    def send_ahead(self, step: Step, timing: StepTiming) -> None:
        """Send `step` (its keep refers to the step in flight) before that step's reply comes back; the
        server runs it next. `receive_ahead` takes its reply, or `drop_ahead` gives it up."""
        if not self.ahead_ready or step.crop is not None or step.n > self.max_nodes:
            raise RuntimeError("a step goes ahead of one whole step in flight, in one request, without a crop")
        assert self._ws is not None
        t0 = time.perf_counter()
        sent = self._on_wire(step)
        message = self._sealed(messages.encode(self._step_message(sent)))
        ws = self._ws
        self._ahead = (sent, ws)
        try:
            ws.send(message)
        except Exception as exc:  # the link failed: the step waits, as sent on it, for a new session
            if not is_transient(exc):
                raise
        timing.serialize_ms += (time.perf_counter() - t0) * 1000
        timing.bytes_up += len(message)

    def receive_ahead(self, timing: StepTiming, while_waiting: Iterator[object] | None = None) -> torch.Tensor:
        """The outputs of the step sent ahead, which becomes the last step (sent again if the link failed)."""
        assert self._ahead is not None
        (sent, ws), self._ahead = self._ahead, None
        self._record.keep(sent.keep)
        return self._deliver(sent, list(sent.keep), timing, while_waiting, awaiting=ws is self._ws)

    def drop_ahead(self) -> None:
        """Give up the step sent ahead: the server ran it (its keep committed), its reply is discarded, and
        the next step crops what it added. One the server never got (the link failed meanwhile) makes the
        next step open a new session and replay."""
        assert self._ahead is not None
        (sent, ws), self._ahead = self._ahead, None
        self._record.keep(sent.keep)
        if ws is self._ws:
            self._drain += 1
        else:
            self._rebuild = True

    def _server_keep(self, keep: Sequence[int]) -> list[int] | None:
        """`keep` as the server sees it: without the entries earlier parts of a cut step committed
        (None if it drops one of those)."""
        done = self._committed
        if list(keep[:done]) != list(range(done)):
            return None
        return [k - done for k in keep[done:]]

    def _keeps(self, parts: list[tuple[int, int]], keep: list[int]) -> list[tuple[int, int, list[int]]]:
        """Each part with its keep: the step's for the first, all of the previous part for the rest."""
        return [(a, b, keep if i == 0 else list(range(parts[i - 1][1] - parts[i - 1][0])))
                for i, (a, b) in enumerate(parts)]

    def _send_part(
        self, sent: Step, start: int, end: int, keep: list[int], timing: StepTiming, waiting: Iterator[object]
    ) -> torch.Tensor:
        """One request of a step (its inputs in the wire dtype): entries [start, end) of it, committing
        `keep` first. A piece of `waiting` runs between sending and receiving."""
        t0 = time.perf_counter()
        assert self._ws is not None
        part = sent.part(start, end, keep)
        message = self._sealed(messages.encode(self._step_message(part)))
        t1 = time.perf_counter()
        self._ws.send(message)
        timing.serialize_ms += (t1 - t0) * 1000
        timing.bytes_up += len(message)
        out = self._receive(part, t1, timing, waiting, whole=end == sent.n)
        self._committed = start
        return out

    def _receive(
        self, part: Step, t1: float, timing: StepTiming, waiting: Iterator[object], whole: bool
    ) -> torch.Tensor:
        """The reply to a request sent at `t1` (time.perf_counter()), after one piece of `waiting` (during
        which a step may go ahead if this request is a `whole` step) and the replies of steps sent ahead
        and dropped (a refused one means the server's cache is not the record's)."""
        assert self._ws is not None
        self._in_flight_whole = whole
        try:
            next(waiting, None)
        finally:
            self._in_flight_whole = False
        for _ in range(self._drain):
            reply = cast(bytes, self._ws.recv(timeout=self.options.step_timeout_s))
            dropped = messages.decode(self._opened(reply), messages.REPLIES)
            self._drain -= 1
            if not isinstance(dropped, ResultMessage):
                raise ConnectionResetError(f"a step sent ahead was refused ({dropped.OP}); replaying")
        reply = cast(bytes, self._ws.recv(timeout=self.options.step_timeout_s))  # the protocol's frames are binary
        t2 = time.perf_counter()
        result = _expect(messages.decode(self._opened(reply), messages.REPLIES), ResultMessage)
        if result.hidden.shape != part.inputs.shape:
            raise ServerError("bad_reply", f"expected hidden states of shape {tuple(part.inputs.shape)} in the reply")
        out = result.hidden.float()
        t3 = time.perf_counter()
        timing.round_trip_ms += (t2 - t1) * 1000
        timing.deserialize_ms += (t3 - t2) * 1000
        timing.server_ms += result.server_ms
        timing.bytes_down += len(reply)
        return out

    def close(self) -> None:
        if self._ws is not None:
            try:
                self._call(CloseMessage(self.session, next(self._ids)), ClosedMessage, self.options.open_timeout_s)
            except Exception:
                pass  # closing is best effort: the server drops the session with the connection anyway
        self._drop()


def _refusal(error: ErrorMessage) -> ServerError:
    return ServerError(error.code, error.message, error.retryable)


def _expect(reply: Reply, kind: type[_R]) -> _R:
    """`reply` if it is of `kind`; the server's refusal (or a `bad_reply`) raised otherwise."""
    if isinstance(reply, ErrorMessage):
        raise _refusal(reply)
    if not isinstance(reply, kind):
        raise ServerError("bad_reply", f"expected {kind.OP!r}, the server answered {reply.OP!r}")
    return reply
