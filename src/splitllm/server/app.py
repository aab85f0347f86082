"""ASGI app of the server: one WebSocket endpoint for sessions, /health for probes, /metrics for Prometheus.

Every request (decoding, opening, stepping) runs on one worker thread, where the layers were loaded,
so the event loop only moves bytes: it keeps answering health checks and other connections while a
forward pass is in flight.
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
from collections import Counter
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from splitllm.protocol import messages, wire
from splitllm.protocol.messages import (
    PROTOCOL_VERSION, CloseMessage, ClosedMessage, ErrorMessage, OpenedMessage, OpenMessage, RequestId,
)
from splitllm.attestation.evidence import load_attester
from splitllm.attestation.handshake import answer
from splitllm.attestation.sealing import SealedChannel, SealError
from splitllm.model.stage import Stage
from splitllm.weights.sources import ModelFiles
from splitllm.server.auth import ANONYMOUS, TokenTable
from splitllm.server.batching import StepBatcher
from splitllm.server.http_guard import TLS_IDENTITY
from splitllm.server.logs import event, log
from splitllm.server.metrics import ServerMetrics
from splitllm.server.sessions import RETRYABLE_CODES, SessionStore
from splitllm.server.settings import ServerSettings
from splitllm.server.steps import PreparedStep, StepRunner
from splitllm.threads import ComputeThread
from splitllm.protocol.wire import ProtocolError


class MiddleServer:
    """The middle layers [first, N - last) of one model and the sessions that use them.

    `tokens`: when set, every WebSocket handshake (and /metrics) needs a bearer token from it.
    """

    def __init__(self, model: str | None, settings: ServerSettings, tokens: TokenTable | None = None) -> None:
        # before any model work
        self.attester = load_attester(settings.attestation, settings.attestation_sim, settings.attestation_collateral)
        self.compute = ComputeThread()  # every request's math runs here, so the weights load (or convert) here too
        self.files = self.compute.run(ModelFiles, model)
        cfg = self.files.config
        cfg.check_split(settings.first, settings.last)
        self.settings = settings
        self.tokens = tokens
        self.start, self.end = settings.first, cfg.num_layers - settings.last
        self.stage = self.compute.run(Stage.load, self.files, self.start, self.end, settings.precision)
        self.fingerprint = self.files.fingerprint
        self.loaded_fingerprint = self.stage.loaded_fingerprint  # what attestation binds (weights/loaded.py)
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
        self._kv_bytes_per_position = self.compute.run(lambda: self.stage.new_cache(1).nbytes)  # linear in max_context
        self.metrics = ServerMetrics(lambda: len(self.sessions), lambda: self.sessions.kv_bytes, settings.max_kv_bytes)
        self.steps = StepRunner(self.stage, settings, self.metrics)
        self._connections = itertools.count(1)
        self._live: Counter[str] = Counter()  # open WebSockets per principal (event loop only)
        self._batcher: StepBatcher[PreparedStep] | None = None

    def _batcher_for_loop(self) -> StepBatcher[PreparedStep] | None:
        """The batcher lives on the serving event loop, so it is made on first use there."""
        if self._batcher is None and self.settings.batch_window_ms > 0:
            s = self.settings
            self._batcher = StepBatcher(
                self.steps.run,
                self.compute.executor,
                s.batch_window_ms / 1000,
                lambda: len(self.sessions),
                owner=lambda p: p.session.principal,
                cost=self.steps.cost,
                max_rows=s.max_batch_rows,
                max_bytes=s.max_batch_bytes,
            )
        return self._batcher

    def info(self, principal: str | None) -> dict[str, Any]:
        """Health: the model for anyone; load figures for an authenticated caller (its own, or all for
        an operator)."""
        out: dict[str, Any] = {
            "status": "ok",
            "model": self.files.config.model_type,
            "fingerprint": self.fingerprint,
            "layers": [self.start, self.end],
            "precision": self.settings.precision.name,
            "attestation": self.settings.attestation,
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
        channel: SealedChannel | None = None
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
            if channel is not None:
                try:
                    message = channel.open(message)
                except SealError as exc:  # tampered, replayed or reordered: the connection and its sessions end
                    self.metrics.errors.labels(f"sealed_{exc.check}", principal).inc()
                    event("sealed_frame_refused", logging.WARNING, connection=conn, check=exc.check)
                    return await self._close(ws, 1008, str(exc)[:120])
                reply = await self._answer(conn, principal, message)
                reply = channel.seal(reply)
            elif self.attester is not None:  # a confidential server answers nothing but the handshake in the clear
                reply, channel = await self._attest(conn, principal, message)
            else:
                reply = await self._answer(conn, principal, message)
            try:
                await asyncio.wait_for(ws.send_bytes(reply), s.send_timeout_s)
            except TimeoutError:
                return "stalled"  # the peer does not read: free its sessions now
            self.metrics.bytes_out.labels(principal).inc(len(reply))

    async def _answer(self, conn: int, principal: str, message: bytes) -> bytes:
        reply = await self.compute.run_async(self._reply, conn, principal, message, self._alone())
        if isinstance(reply, PreparedStep):
            reply = await self._batcher_for_loop().submit(reply)  # type: ignore[union-attr]
        return reply

    async def _attest(self, conn: int, principal: str, message: bytes) -> tuple[bytes, SealedChannel | None]:
        """The `evidence` for an `attest` request and the channel that seals the rest of the connection; an
        error frame for anything else."""
        request_id: RequestId = None
        try:
            frame = wire.decode(message)  # the handshake's messages are attestation.handshake's header maps
            request_id = messages.request_id(frame)
            if frame.header["op"] != "attest":
                raise ProtocolError("attestation_required", "this server runs in a confidential VM and serves sealed "
                                    "sessions only: attest it first (--attestation-policy)")
            messages.check_version(frame.header.get("version"))
            try:
                evidence, channel = await asyncio.to_thread(
                    answer, frame.header, self.attester, self.fingerprint, self.loaded_fingerprint,
                    (self.start, self.end),
                    PROTOCOL_VERSION,
                )
            except ValueError as exc:
                raise ProtocolError("bad_request", str(exc)) from None
            # the firmware did not answer: this request fails, the server goes on
            except (OSError, RuntimeError) as exc:
                log.exception("no attestation report", extra={"fields": {"connection": conn}})
                raise ProtocolError("evidence_unavailable", f"the server could not obtain a report: {exc}") from None
        except ProtocolError as exc:
            return self._refused(conn, principal, request_id, exc), None
        event("attested", connection=conn, principal=principal, platform=evidence.platform)
        return wire.encode(evidence.header(request_id)), channel

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
        """The reply frame, or (`alone` false) a checked step for the batcher to run with others."""
        request_id: RequestId = None
        try:
            if len(message) > self.settings.max_frame_bytes:
                raise ProtocolError("frame_too_large", f"frame exceeds {self.settings.max_frame_bytes} bytes")
            frame = wire.decode(message)
            request_id = messages.request_id(frame)
            if frame.header["op"] == "attest":
                raise self._misplaced_attest()
            request = messages.parse(frame, messages.REQUESTS)
            if isinstance(request, OpenMessage):
                return self._open(conn, principal, request)
            if isinstance(request, CloseMessage):
                self.sessions.get(request.session, conn, principal)
                self.sessions.close(request.session, "closed by client")
                return messages.encode(ClosedMessage(request.id))
            session = self.sessions.get(request.session, conn, principal)
            prepared = self.steps.prepare(session, request)
            if not alone or (len(prepared.parts) > 1 and self._batcher is not None):
                return prepared  # a sliced step takes turns even when it is alone now
            while (reply := self.steps.run([prepared])[0]) is None:
                pass
            return reply
        except ProtocolError as exc:
            return self._refused(conn, principal, request_id, exc)
        except Exception as exc:  # never let one request take the server down
            self.metrics.errors.labels("internal", principal).inc()
            log.exception("internal error", extra={"fields": {"connection": conn}})
            return messages.encode(ErrorMessage("internal", f"internal error: {type(exc).__name__}", True, request_id))

    def _misplaced_attest(self) -> ProtocolError:
        """Why an `attest` is refused where the handshake cannot happen (it only ever opens a confidential
        server's connection)."""
        if self.attester is None:
            return ProtocolError("attestation_unavailable", "this server runs without --attestation: it offers no "
                                 "evidence, and its operator can read the hidden states")
        return ProtocolError("already_attested", "this connection is already attested and sealed")

    def _refused(self, conn: int, principal: str, request_id: RequestId, exc: ProtocolError) -> bytes:
        """The error frame of a refused request, counted and logged."""
        self.metrics.errors.labels(exc.code, principal).inc()
        event("request_refused", logging.DEBUG, connection=conn, code=exc.code)
        return messages.encode(ErrorMessage(exc.code, exc.message, exc.code in RETRYABLE_CODES, request_id))

    def _open(self, conn: int, principal: str, request: OpenMessage) -> bytes:
        """A session for a client of this protocol version (checked on receipt) with these weights and split."""
        if request.fingerprint != self.fingerprint:
            raise ProtocolError(
                "model_mismatch",
                f"client and server weights differ: the server runs {self.files.path.name} (fingerprint "
                f"{self.fingerprint[:16]}), the client's fingerprint is {request.fingerprint[:16] or 'missing'}",
            )
        if request.layers != (self.start, self.end):
            shown = f"[{request.layers[0]}, {request.layers[1]})"
            last = self.files.config.num_layers - self.end
            raise ProtocolError(
                "split_mismatch",
                f"server runs layers [{self.start}, {self.end}) (a client with --first {self.start} --last {last}), "
                f"client asked for {shown}",
            )
        want = self.settings.max_context if request.max_context is None else request.max_context
        max_context = min(want, self.settings.max_context, self.files.config.max_position)
        session = self.sessions.open(
            conn, principal, max_context * self._kv_bytes_per_position, lambda: self.stage.new_cache(max_context),
            request.dtype,
        )
        self.metrics.sessions_opened.labels(principal).inc()
        return messages.encode(OpenedMessage(session.id, max_context, self.settings.max_nodes_per_step, request.id,
                                             self.stage.row_invariant))

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
    async def lifespan(_app: Starlette):
        reaper = asyncio.create_task(server.reap())
        yield
        reaper.cancel()

    return Starlette(
        routes=[Route("/health", health), Route("/metrics", metrics), WebSocketRoute("/ws", server.handle)],
        lifespan=lifespan,
    )
