"""ASGI app of the server: one WebSocket endpoint for sessions, /health for probes, /metrics for Prometheus.

Every request (decoding, opening, stepping) runs on one worker thread, so the event loop only moves
bytes: it keeps answering health checks and other connections while a forward pass is in flight.
Each connection has at most one request in flight and waits for its reply to be taken under a
timeout, so a peer that stops reading ties up nothing but its own connection, briefly.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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
    max_nodes_per_step: int = 4096
    max_frame_bytes: int = 64 << 20
    max_sessions_per_principal: int | None = None  # None: any principal may hold all max_sessions
    max_kv_bytes: int = 8 << 30  # KV caches are preallocated: this bounds the memory sessions can take
    idle_timeout_s: float = 600.0  # a connection silent this long is closed
    send_timeout_s: float = 30.0  # a reply the peer does not take within this ends its connection
    max_connections: int = 256  # further connections get HTTP 503
    batch_window_ms: float = 2.0  # steps of different sessions this close together share a forward; 0: off

    @property
    def precision(self) -> Precision:
        return Precision(self.dtype, self.quant, self.device)


@dataclass(frozen=True)
class PreparedStep:
    """A validated step request, ready to run alone or in a batch with other sessions' steps."""

    session: Session
    request_id: Any
    step: StepInput


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
        self.sessions = SessionStore(
            settings.max_sessions, settings.session_ttl_s, settings.max_sessions_per_principal, settings.max_kv_bytes
        )
        self._kv_bytes_per_position = self.stage.new_cache(1).nbytes  # caches are linear in max_context
        self.metrics = ServerMetrics(lambda: len(self.sessions), lambda: self.sessions.kv_bytes, settings.max_kv_bytes)
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="splitllm-compute")
        self._connections = itertools.count(1)
        self._batcher: StepBatcher[PreparedStep] | None = None

    def _batcher_for_loop(self) -> StepBatcher[PreparedStep] | None:
        """The batcher lives on the serving event loop, so it is made on first use there."""
        if self._batcher is None and self.settings.batch_window_ms > 0:
            self._batcher = StepBatcher(
                self._run_steps, self._compute, self.settings.batch_window_ms / 1000, lambda: len(self.sessions)
            )
        return self._batcher

    def info(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "model": self.files.config.model_type,
            "fingerprint": self.fingerprint,
            "layers": [self.start, self.end],
            "precision": self.settings.precision.name,
            "sessions": len(self.sessions),
            "kv_bytes": self.sessions.kv_bytes,
            "kv_bytes_limit": self.settings.max_kv_bytes,
        }

    def principal(self, authorization: str | None) -> str | None:
        """Who a request's Authorization header proves to be (anyone, without a token table)."""
        return ANONYMOUS if self.tokens is None else self.tokens.principal(authorization)

    async def handle(self, ws: WebSocket) -> None:
        peer = f"{ws.client.host}:{ws.client.port}" if ws.client else "?"
        principal = self.principal(ws.headers.get("authorization"))
        if principal is None:
            # Refused before accept: no session, no model work; the client sees HTTP 403. (uvicorn's
            # default WebSocket stack logs a spurious error after a 401 denial response, so no 401 here.)
            self.metrics.refused.labels("unauthenticated").inc()
            event("handshake_refused", logging.WARNING, reason="unauthenticated", peer=peer)
            await ws.close(1008)
            return
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
            self.metrics.bytes_in.inc(len(message))
            reply = await loop.run_in_executor(self._compute, self._reply, conn, principal, message, self._alone())
            if isinstance(reply, PreparedStep):
                reply = await self._batcher_for_loop().submit(reply)  # type: ignore[union-attr]
            try:
                await asyncio.wait_for(ws.send_bytes(reply), s.send_timeout_s)
            except TimeoutError:
                return "stalled"  # the peer does not read: free its sessions now
            self.metrics.bytes_out.inc(len(reply))

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
                return self._run_steps([prepared])[0] if alone else prepared
            if op == "close":
                self.sessions.get(frame.header.get("session"), conn, principal)
                self.sessions.close(frame.header["session"], "closed by client")
                return wire.encode({"op": "closed", "id": request_id})
            raise ProtocolError("unknown_op", f"unknown op {op!r}; expected open, step or close")
        except ProtocolError as exc:
            self.metrics.errors.labels(exc.code).inc()
            event("request_refused", logging.DEBUG, connection=conn, code=exc.code)
            return wire.error_frame(request_id, exc.code, exc.message, exc.code in RETRYABLE_CODES)
        except Exception as exc:  # never let one request take the server down
            self.metrics.errors.labels("internal").inc()
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
        self.metrics.sessions_opened.inc()
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
        return PreparedStep(session, h.get("id"), step)

    def _run_steps(self, prepared: list[PreparedStep]) -> list[bytes]:
        """Run validated steps (one session each) as one forward pass; all-or-nothing on the caches."""
        t0 = time.perf_counter()
        restores = [p.session.cache.checkpoint(p.step.keep) for p in prepared]
        try:
            outs = self.stage.forward_many([p.step for p in prepared])
        except Exception as exc:
            # The steps passed validation, so a failure here is the server's: its caches are restored
            # and the same step may be sent again.
            for restore in restores:
                restore()
            self.metrics.errors.labels("internal").inc()
            log.exception("step failed mid-forward; caches restored", extra={"fields": {"batch": len(prepared)}})
            message = f"internal error: {type(exc).__name__}"
            return [wire.error_frame(p.request_id, "internal", message, retryable=True) for p in prepared]
        except BaseException:
            for restore in restores:
                restore()
            raise
        elapsed = time.perf_counter() - t0
        self.metrics.step_seconds.observe(elapsed)
        self.metrics.batch_size.observe(len(prepared))
        replies = []
        for p, out in zip(prepared, outs):
            p.session.steps += 1
            n = out.shape[0]
            self.metrics.steps.inc()
            self.metrics.step_nodes.inc(n)
            event(
                "step", logging.DEBUG, session=session_tag(p.session.id), nodes=n, keep=len(p.step.keep),
                batch=len(prepared), ms=elapsed * 1000,
            )
            header = {"op": "result", "id": p.request_id, "server_ms": elapsed * 1000}
            replies.append(wire.encode(header, out, p.session.wire_dtype))
        return replies

    async def reap(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, self.sessions.ttl_s))
            self.sessions.expire()


def create_app(server: MiddleServer) -> Starlette:
    async def health(_request: Request) -> JSONResponse:
        return JSONResponse(server.info())

    async def metrics(request: Request) -> Response:
        if server.principal(request.headers.get("authorization")) is None:
            return PlainTextResponse("authentication failed\n", 401, headers={"WWW-Authenticate": "Bearer"})
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette):  # type: ignore[no-untyped-def]
        reaper = asyncio.create_task(server.reap())
        yield
        reaper.cancel()

    return Starlette(
        routes=[Route("/health", health), Route("/metrics", metrics), WebSocketRoute("/ws", server.handle)],
        lifespan=lifespan,
    )
