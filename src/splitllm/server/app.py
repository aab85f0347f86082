"""ASGI app of the server: one WebSocket endpoint for sessions, /health for probes, /metrics for Prometheus.

Every request (decoding, opening, stepping) runs on one worker thread, so the event loop only moves
bytes: it keeps answering health checks and other connections while a forward pass is in flight.
Each connection has at most one request in flight and waits for its reply to be taken under a
timeout, so a peer that stops reading ties up nothing but its own connection, briefly.

Admission happens here, where the principal is known: connections (WebSockets included) are capped
in total and per principal, sessions per principal, and /health stays outside every cap. What a
caller learns is scoped to it: /health shows load only to an authenticated caller, /metrics only
the caller's own counters (the whole server's to an operator principal).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from splitllm import wire
from splitllm.model.stage import Stage, StepInput
from splitllm.model.precision import Precision
from splitllm.model.weights import ModelFiles
from splitllm.server.auth import ANONYMOUS, TokenTable
from splitllm.server.logs import event, log, session_tag
from splitllm.server.metrics import ServerMetrics
from splitllm.server.batching import StepBatcher
from splitllm.server.http_guard import TLS_IDENTITY
from splitllm.server.sessions import RETRYABLE_CODES, Session, SessionStore
from splitllm.visibility import Visibility
from splitllm.wire import ProtocolError


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    """Everything a server is configured with, by name (`splitllm serve` maps its options here)."""

    head: int = 2
    tail: int = 2
    dtype: torch.dtype = torch.float32
    quant: str = "none"  # weight-only quantization of the middle layers: none, int8 or int4
    device: str = "cpu"
    max_context: int = 4096
    max_sessions: int = 64
    session_ttl_s: float = 600.0
    max_nodes_per_step: int = 256  # announced to clients, which split longer prefills into steps this size
    max_frame_bytes: int = 64 << 20
    max_sessions_per_principal: int | None = None  # None: a quarter of max_sessions with tokens, else all
    max_kv_bytes: int = 8 << 30  # KV caches are preallocated: this bounds the memory sessions can take
    idle_timeout_s: float = 600.0  # a connection silent this long is closed
    send_timeout_s: float = 30.0  # a reply the peer does not take within this ends its connection
    max_connections: int = 256  # further WebSockets are closed with 1013, try again later (/health never is)
    batch_window_ms: float = 2.0  # steps of different sessions this close together share a forward; 0: off
    # None: with a token table, a quarter of max_connections / max_sessions; without one, all of them.
    max_connections_per_principal: int | None = None
    operators: tuple[str, ...] = ()  # principals whose /health and /metrics show the whole server
    max_batch_rows: int = 256  # positions in one shared forward; more waiting steps run in later forwards
    slice_rows: int = 16  # a step longer than slice_above runs as forwards of this many positions, others' steps in between
    slice_above: int = 64  # a step this long or shorter (a speculative tree) always runs in one forward
    max_batch_bytes: int = 256 << 20  # estimated activation and mask bytes of one shared forward
    handshake_timeout_s: float = 10.0  # a request head not complete this long after connecting is dropped
    max_header_bytes: int = 16 << 10  # request line plus headers
    max_header_lines: int = 64

    def __post_init__(self) -> None:
        for name in ("max_nodes_per_step", "max_batch_rows", "slice_rows", "slice_above"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    @property
    def precision(self) -> Precision:
        return Precision(self.dtype, self.quant, self.device)


@dataclass
class PreparedStep:
    """A validated step request, ready to run alone or in a batch with other sessions' steps.

    A step longer than `slice_above` (a prompt) runs as forwards of `slice_rows` (`parts`, cut where the result stays
    exact), one per turn, so other sessions' steps run in between: a long prompt delays everyone
    else by one slice at a time, not by its whole length.
    """

    session: Session
    request_id: Any
    step: StepInput
    parts: list[tuple[int, int]]
    done: int = 0  # parts run so far
    outs: list[torch.Tensor] = field(default_factory=list)
    rollback: Callable[[], None] = lambda: None  # back to the cache before the first part
    compute_s: float = 0.0

    def next_input(self) -> StepInput:
        """The next part as a step of its own: it commits the whole previous part."""
        s = self.step
        if len(self.parts) == 1:
            return s
        (a, b), keep = self.parts[self.done], s.keep
        if self.done:
            prev = self.parts[self.done - 1]
            keep = list(range(prev[1] - prev[0]))
        return StepInput(s.cache, s.hidden[a:b], s.positions[a:b], s.vis.part(a, b), keep)

    def rows(self) -> int:
        a, b = self.parts[self.done]
        return b - a


class MiddleServer:
    """The middle layers [head, N - tail) of one model and the sessions that use them.

    `tokens`: when set, every WebSocket handshake (and /metrics) needs a bearer token from it.
    """

    def __init__(self, model: str | None, settings: ServerSettings, tokens: TokenTable | None = None) -> None:
        self.files = ModelFiles(model)
        cfg = self.files.config
        cfg.check_split(settings.head, settings.tail)
        self.settings = settings
        self.tokens = tokens
        self.start, self.end = settings.head, cfg.num_layers - settings.tail
        self.stage = Stage.load(self.files, self.start, self.end, settings.precision)
        self.fingerprint = self.files.fingerprint
        shared = tokens is not None  # several principals: none may take the whole server by default
        self.sessions = SessionStore(
            settings.max_sessions,
            settings.session_ttl_s,
            settings.max_sessions_per_principal or (max(1, settings.max_sessions // 4) if shared else None),
            settings.max_kv_bytes,
        )
        self.max_connections_per_principal = settings.max_connections_per_principal or (
            max(1, settings.max_connections // 4) if shared else settings.max_connections
        )
        self._kv_bytes_per_position = self.stage.new_cache(1).nbytes  # caches are linear in max_context
        self.metrics = ServerMetrics(lambda: len(self.sessions), lambda: self.sessions.kv_bytes, settings.max_kv_bytes)
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="splitllm-compute")
        self._connections = itertools.count(1)
        self._live: Counter[str] = Counter()  # open WebSockets per principal (event loop only)
        self._batcher: StepBatcher[PreparedStep] | None = None

    def _batcher_for_loop(self) -> StepBatcher[PreparedStep] | None:
        """The batcher lives on the serving event loop, so it is made on first use there."""
        if self._batcher is None and self.settings.batch_window_ms > 0:
            s = self.settings
            self._batcher = StepBatcher(
                self._run_steps,
                self._compute,
                s.batch_window_ms / 1000,
                lambda: len(self.sessions),
                owner=lambda p: p.session.principal,
                cost=self._step_cost,
                max_rows=s.max_batch_rows,
                max_bytes=s.max_batch_bytes,
            )
        return self._batcher

    def _step_cost(self, prepared: PreparedStep) -> tuple[int, int]:
        """Rows and estimated transient bytes of a step: activations (the MLP's widest) and its masks."""
        cfg, step = self.files.config, prepared.step
        n = prepared.rows()
        context = step.cache.length + len(step.keep) + prepared.parts[prepared.done][1]
        itemsize = torch.finfo(self.settings.dtype).bits // 8
        activations = n * (4 * cfg.hidden_size + 3 * cfg.intermediate_size) * itemsize
        masks = len(set(self.stage.windows)) * n * context * itemsize
        return n, activations + masks

    def info(self, principal: str | None) -> dict[str, Any]:
        """Health: the model for anyone; load figures for an authenticated caller (its own, or all for
        an operator)."""
        out: dict[str, Any] = {
            "status": "ok",
            "model": self.files.config.model_type,
            "fingerprint": self.fingerprint,
            "layers": [self.start, self.end],
            "precision": self.settings.precision.name,
        }
        if principal is None:
            return out
        if self.is_operator(principal):
            return out | {
                "sessions": len(self.sessions),
                "kv_bytes": self.sessions.kv_bytes,
                "kv_bytes_limit": self.settings.max_kv_bytes,
                "connections": sum(self._live.values()),
            }
        return out | {"sessions": self.sessions.count(principal), "kv_bytes": self.sessions.kv_bytes_of(principal)}

    def principal(self, authorization: str | None, identity: str | None = None) -> str | None:
        """Who a request proves to be: the token's principal (anyone, without a token table).

        `identity`: the client certificate's common name under mutual TLS. Alone it names the
        principal; with tokens, the token must belong to that same principal.
        """
        if self.tokens is None:
            return identity or ANONYMOUS
        principal = self.tokens.principal(authorization)
        return principal if identity is None or principal == identity else None

    def is_operator(self, principal: str) -> bool:
        """Operators see the whole server; on an open server (no tokens, no client certificates) the
        one anonymous principal is everyone, and sees it too."""
        return principal in self.settings.operators or (self.tokens is None and principal == ANONYMOUS)

    def _refuse_connection(self, principal: str) -> tuple[str, str] | None:
        """(reason, message) when a new connection would cross a cap; None to admit it."""
        if sum(self._live.values()) >= self.settings.max_connections:
            return "server_busy", f"server holds its maximum of {self.settings.max_connections} connections"
        if self._live[principal] >= self.max_connections_per_principal:
            return "principal_busy", f"at most {self.max_connections_per_principal} connections per principal"
        return None

    async def handle(self, ws: WebSocket) -> None:
        peer = f"{ws.client.host}:{ws.client.port}" if ws.client else "?"
        principal = self.principal(ws.headers.get("authorization"), ws.scope.get("state", {}).get(TLS_IDENTITY))
        if principal is None:
            # Refused before accept: no session, no model work; the client sees HTTP 403. (uvicorn's
            # default WebSocket stack logs a spurious error after a 401 denial response, so no 401 here.)
            self.metrics.refused.labels("unauthenticated").inc()
            event("handshake_refused", logging.WARNING, reason="unauthenticated", peer=peer)
            await ws.close(1008)
            return
        refusal = self._refuse_connection(principal)
        if refusal is not None:
            reason, message = refusal
            self.metrics.refused.labels(reason).inc()
            event("handshake_refused", logging.INFO, reason=reason, peer=peer, principal=principal)
            # Accepted only to be closed with 1013 "try again later", which clients retry: an HTTP
            # denial response makes uvicorn log a spurious error, and Ray's proxy has none.
            await ws.accept()
            await ws.close(1013, f"{message}; retry later")
            return
        self._live[principal] += 1
        try:
            await self._handle_admitted(ws, peer, principal)
        finally:
            self._live[principal] -= 1
            if not self._live[principal]:
                del self._live[principal]

    async def _handle_admitted(self, ws: WebSocket, peer: str, principal: str) -> None:
        await ws.accept()
        conn = next(self._connections)
        self.metrics.connections.inc()
        event("connection_opened", connection=conn, principal=principal, peer=peer)
        reason = "closed by peer"
        try:
            reason = await self._serve(ws, conn, principal)
        except WebSocketDisconnect:
            pass
        except Exception:  # a fault of ours: this connection ends, the server and other peers go on
            reason = "internal error"
            log.exception("connection failed", extra={"fields": {"connection": conn}})
        finally:
            self.sessions.close_connection(conn)
            self.metrics.connections.dec()
            if reason != "closed by peer":
                self.metrics.dropped.labels(reason).inc()
            event("connection_closed", connection=conn, reason=reason)

    async def _serve(self, ws: WebSocket, conn: int, principal: str) -> str:
        """Answer one request at a time until the peer leaves, goes idle or stops taking replies."""
        s = self.settings
        loop = asyncio.get_running_loop()
        while True:
            try:
                received = await asyncio.wait_for(ws.receive(), s.idle_timeout_s)
            except TimeoutError:
                return await self._close(ws, 1000, "idle")
            if received["type"] == "websocket.disconnect":
                return "closed by peer"
            message = received.get("bytes")
            if message is None:  # a text frame: the protocol is binary
                return await self._close(ws, 1003, "binary frames only")
            self.metrics.bytes_in.labels(principal).inc(len(message))
            reply = await loop.run_in_executor(self._compute, self._reply, conn, principal, message, self._alone())
            if isinstance(reply, PreparedStep):
                reply = await self._batcher_for_loop().submit(reply)  # type: ignore[union-attr]
            try:
                await asyncio.wait_for(ws.send_bytes(reply), s.send_timeout_s)
            except TimeoutError:
                return "stalled"  # the peer does not read: free its sessions now
            self.metrics.bytes_out.labels(principal).inc(len(reply))

    async def _close(self, ws: WebSocket, code: int, reason: str) -> str:
        """Close with `code` (a peer that does not take the close frame is dropped anyway); return why."""
        with contextlib.suppress(WebSocketDisconnect, OSError, TimeoutError):
            await asyncio.wait_for(ws.close(code, reason), self.settings.send_timeout_s)
        return reason

    def _alone(self) -> bool:
        """Whether a step arriving now has nobody to share a forward with: then it runs at once, on the
        same worker-thread hand-off as its validation (each hand-off costs a thread wake-up)."""
        batcher = self._batcher_for_loop()
        return batcher is None or (batcher.idle and len(self.sessions) <= 1)

    def _reply(self, conn: int, principal: str, message: bytes, alone: bool = True) -> bytes | PreparedStep:
        """The reply frame, or (`alone` false) a validated step for the batcher to run with others."""
        request_id = None
        try:
            if len(message) > self.settings.max_frame_bytes:
                raise ProtocolError("frame_too_large", f"frame exceeds {self.settings.max_frame_bytes} bytes")
            frame = wire.decode(message)
            request_id = frame.header.get("id")
            op = frame.header["op"]
            if op == "open":
                return self._open(conn, principal, frame)
            if op == "step":
                prepared = self._prepare_step(conn, principal, frame)
                if not alone or (len(prepared.parts) > 1 and self._batcher is not None):
                    return prepared  # a sliced step takes turns even when it is alone now
                while (reply := self._run_steps([prepared])[0]) is None:
                    pass
                return reply
            if op == "close":
                self.sessions.get(frame.header.get("session"), conn, principal)
                self.sessions.close(frame.header["session"], "closed by client")
                return wire.encode({"op": "closed", "id": request_id})
            raise ProtocolError("unknown_op", f"unknown op {op!r}; expected open, step or close")
        except ProtocolError as exc:
            self.metrics.errors.labels(exc.code, principal).inc()
            event("request_refused", logging.DEBUG, connection=conn, code=exc.code)
            return wire.error_frame(request_id, exc.code, exc.message, exc.code in RETRYABLE_CODES)
        except Exception as exc:  # never let one request take the server down
            self.metrics.errors.labels("internal", principal).inc()
            log.exception("internal error", extra={"fields": {"connection": conn}})
            return wire.error_frame(request_id, "internal", f"internal error: {type(exc).__name__}", retryable=True)

    def _open(self, conn: int, principal: str, frame: wire.Frame) -> bytes:
        h = frame.header
        if h.get("version") != wire.PROTOCOL_VERSION:
            raise ProtocolError("version_mismatch", f"server speaks protocol {wire.PROTOCOL_VERSION}, got {h.get('version')!r}")
        if h.get("fingerprint") != self.fingerprint:
            raise ProtocolError("model_mismatch", "client and server weights differ (model fingerprint mismatch)")
        if h.get("layers") != [self.start, self.end]:
            raise ProtocolError(
                "split_mismatch", f"server runs layers [{self.start}, {self.end}), client asked for {h.get('layers')!r}"
            )
        dtype = h.get("dtype")
        if not isinstance(dtype, str) or dtype not in wire.WIRE_DTYPES:
            raise ProtocolError("bad_dtype", f"wire dtype must be one of {', '.join(wire.WIRE_DTYPES)}")
        want = h.get("max_context", self.settings.max_context)
        if not isinstance(want, int) or isinstance(want, bool) or want < 1:
            raise ProtocolError("bad_request", "max_context must be a positive integer")
        max_context = min(want, self.settings.max_context, self.files.config.max_position)
        session = self.sessions.open(
            conn, principal, max_context * self._kv_bytes_per_position, lambda: self.stage.new_cache(max_context), dtype
        )
        self.metrics.sessions_opened.labels(principal).inc()
        return wire.encode(
            {
                "op": "opened",
                "id": h.get("id"),
                "session": session.id,
                "max_context": max_context,
                "max_nodes": self.settings.max_nodes_per_step,
            }
        )

    def _prepare_step(self, conn: int, principal: str, frame: wire.Frame) -> PreparedStep:
        h = frame.header
        session = self.sessions.get(h.get("session"), conn, principal)
        hidden = frame.tensor
        if hidden is None:
            raise ProtocolError("bad_shape", "a step carries hidden states")
        if h["dtype"] != session.wire_dtype:
            raise ProtocolError("bad_dtype", f"session uses {session.wire_dtype} on the wire, got {h['dtype']}")
        n, width = hidden.shape
        if width != self.files.config.hidden_size:
            raise ProtocolError("bad_shape", f"hidden size must be {self.files.config.hidden_size}, got {width}")
        if n > self.settings.max_nodes_per_step:
            raise ProtocolError("too_many_nodes", f"at most {self.settings.max_nodes_per_step} positions per step")
        positions = h.get("positions")
        if not isinstance(positions, list) or len(positions) != n or not all(
            isinstance(p, int) and not isinstance(p, bool) for p in positions
        ):
            raise ProtocolError("bad_positions", f"positions must be a list of {n} integers")
        keep = h.get("keep", [])
        if not isinstance(keep, list):
            raise ProtocolError("bad_keep", "keep must be a list of indices")
        if not bool(torch.isfinite(hidden).all()):
            raise ProtocolError("bad_values", "hidden states contain NaN or Inf")
        try:
            vis = Visibility.from_wire(h, n)
            step = StepInput(session.cache, hidden.to(self.settings.dtype), torch.tensor(positions, dtype=torch.long), vis, keep)
            self.stage.check_step(step.cache, step.hidden, step.positions, step.vis, step.keep)
        except (ValueError, OverflowError, RuntimeError) as exc:
            raise ProtocolError("bad_request", str(exc)) from None
        parts = [(0, n)] if n <= self.settings.slice_above else vis.cuts(self.settings.slice_rows)
        return PreparedStep(session, h.get("id"), step, parts)

    def _run_steps(self, prepared: list[PreparedStep]) -> list[bytes | None]:
        """Run the next part of validated steps (one session each) as one forward pass.

        A reply is None while a step has parts left. All-or-nothing on the caches: when a shared
        forward fails, every cache is restored and each step runs again alone, so the step that
        caused the failure gets the error (its cache as before the step) and the bystanders their
        exact results.
        """
        t0 = time.perf_counter()
        inputs = [p.next_input() for p in prepared]
        restores = [i.cache.checkpoint(i.keep) for i in inputs]
        for p, restore in zip(prepared, restores):
            if p.done == 0:
                p.rollback = restore
        try:
            outs = self.stage.forward_many(inputs)
        except Exception as exc:
            # The steps passed validation, so a failure here is the server's: its caches are restored
            # and the same step may be sent again.
            for restore in restores:
                restore()
            if len(prepared) > 1:
                log.warning("shared forward failed; its steps run again alone", extra={"fields": {"batch": len(prepared)}})
                return [reply for p in prepared for reply in self._run_steps([p])]
            prepared[0].rollback()
            self.metrics.errors.labels("internal", prepared[0].session.principal).inc()
            log.exception("step failed mid-forward; cache restored")
            message = f"internal error: {type(exc).__name__}"
            return [wire.error_frame(prepared[0].request_id, "internal", message, retryable=True)]
        except BaseException:
            for p in prepared:
                p.rollback()
            raise
        elapsed = time.perf_counter() - t0
        self.metrics.step_seconds.observe(elapsed)
        self.metrics.batch_size.observe(len(prepared))
        replies: list[bytes | None] = []
        for p, part_out in zip(prepared, outs):
            p.outs.append(part_out)
            p.done += 1
            p.compute_s += elapsed
            if p.done < len(p.parts):
                replies.append(None)
                continue
            if len(p.parts) > 1:
                p.step.cache.reopen(p.parts[-1][0])  # as if one forward had run the whole step
            out = torch.cat(p.outs) if len(p.outs) > 1 else part_out
            p.session.steps += 1
            n = out.shape[0]
            self.metrics.steps.labels(p.session.principal).inc()
            self.metrics.step_nodes.labels(p.session.principal).inc(n)
            event(
                "step", logging.DEBUG, session=session_tag(p.session.id), nodes=n, keep=len(p.step.keep),
                batch=len(prepared), ms=p.compute_s * 1000,
            )
            header = {"op": "result", "id": p.request_id, "server_ms": p.compute_s * 1000}
            replies.append(wire.encode(header, out, p.session.wire_dtype))
        return replies

    async def reap(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, self.sessions.ttl_s))
            self.sessions.expire()


def create_app(server: MiddleServer) -> Starlette:
    def caller(request: Request) -> str | None:
        return server.principal(request.headers.get("authorization"), request.scope.get("state", {}).get(TLS_IDENTITY))

    async def health(request: Request) -> JSONResponse:
        return JSONResponse(server.info(caller(request)))

    async def metrics(request: Request) -> Response:
        principal = caller(request)
        if principal is None:
            return PlainTextResponse("authentication failed\n", 401, headers={"WWW-Authenticate": "Bearer"})
        scope = None if server.is_operator(principal) else principal
        return Response(server.metrics.render(scope), media_type=CONTENT_TYPE_LATEST)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette):  # type: ignore[no-untyped-def]
        reaper = asyncio.create_task(server.reap())
        yield
        reaper.cancel()

    return Starlette(
        routes=[Route("/health", health), Route("/metrics", metrics), WebSocketRoute("/ws", server.handle)],
        lifespan=lifespan,
    )
