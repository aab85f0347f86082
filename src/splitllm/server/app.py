"""ASGI app of the server: one WebSocket endpoint for sessions, /health for probes.

Compute runs on one worker thread, so the event loop keeps answering (health, other
connections' framing and errors) while a forward pass is in flight.
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
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from splitllm import wire
from splitllm.model.stage import Stage
from splitllm.model.weights import ModelFiles
from splitllm.server.sessions import SessionStore
from splitllm.visibility import Visibility
from splitllm.wire import ProtocolError

log = logging.getLogger("splitllm.server")


@dataclass(frozen=True)
class ServerSettings:
    head: int = 2
    tail: int = 2
    dtype: torch.dtype = torch.float32
    max_context: int = 4096
    max_sessions: int = 64
    session_ttl_s: float = 600.0
    max_nodes_per_step: int = 4096
    max_frame_bytes: int = 64 << 20


class MiddleServer:
    """The middle layers [head, N - tail) of one model and the sessions that use them."""

    def __init__(self, model: str | None, settings: ServerSettings) -> None:
        self.files = ModelFiles(model)
        cfg = self.files.config
        cfg.check_split(settings.head, settings.tail)
        self.settings = settings
        self.start, self.end = settings.head, cfg.num_layers - settings.tail
        self.stage = Stage.load(self.files, self.start, self.end, settings.dtype)
        self.fingerprint = self.files.fingerprint
        self.sessions = SessionStore(settings.max_sessions, settings.session_ttl_s)
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="splitllm-compute")
        self._connections = itertools.count(1)

    def info(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "model": self.files.config.model_type,
            "fingerprint": self.fingerprint,
            "layers": [self.start, self.end],
            "sessions": len(self.sessions),
            "kv_bytes": self.sessions.kv_bytes,
        }

    async def handle(self, ws: WebSocket) -> None:
        await ws.accept()
        conn = next(self._connections)
        try:
            while True:
                message = await ws.receive_bytes()
                reply = await self._reply(conn, message)
                await ws.send_bytes(reply)
        except (WebSocketDisconnect, KeyError, RuntimeError):
            # KeyError/RuntimeError: a text frame or a receive after close; the peer is gone or broken.
            pass
        finally:
            self.sessions.close_connection(conn)

    async def _reply(self, conn: int, message: bytes) -> bytes:
        request_id = None
        try:
            if len(message) > self.settings.max_frame_bytes:
                raise ProtocolError("frame_too_large", f"frame exceeds {self.settings.max_frame_bytes} bytes")
            frame = wire.decode(message)
            request_id = frame.header.get("id")
            op = frame.header["op"]
            if op == "open":
                return self._open(conn, frame)
            if op == "step":
                return await asyncio.get_running_loop().run_in_executor(self._compute, self._step, conn, frame)
            if op == "close":
                self.sessions.get(frame.header.get("session"), conn)
                self.sessions.close(frame.header["session"], "closed by client")
                return wire.encode({"op": "closed", "id": request_id})
            raise ProtocolError("unknown_op", f"unknown op {op!r}; expected open, step or close")
        except ProtocolError as exc:
            return wire.error_frame(request_id, exc.code, exc.message)
        except Exception as exc:  # never let one request take the server down
            log.exception("internal error")
            return wire.error_frame(request_id, "internal", f"internal error: {type(exc).__name__}")

    def _open(self, conn: int, frame: wire.Frame) -> bytes:
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
        if dtype not in wire.WIRE_DTYPES:
            raise ProtocolError("bad_dtype", f"wire dtype must be one of {', '.join(wire.WIRE_DTYPES)}")
        want = h.get("max_context", self.settings.max_context)
        if not isinstance(want, int) or want < 1:
            raise ProtocolError("bad_request", "max_context must be a positive integer")
        max_context = min(want, self.settings.max_context, self.files.config.max_position)
        session = self.sessions.open(conn, self.stage.new_cache(max_context), dtype)
        return wire.encode({"op": "opened", "id": h.get("id"), "session": session.id, "max_context": max_context})

    def _step(self, conn: int, frame: wire.Frame) -> bytes:
        h = frame.header
        session = self.sessions.get(h.get("session"), conn)
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
        t0 = time.perf_counter()
        try:
            vis = Visibility.from_wire(h, n)
            pos = torch.tensor(positions, dtype=torch.long)
            # Stage.forward validates everything before it touches the cache.
            out = self.stage(session.cache, hidden.to(self.settings.dtype), pos, vis, keep)
        except (ValueError, OverflowError, RuntimeError) as exc:
            raise ProtocolError("bad_request", str(exc)) from None
        server_ms = (time.perf_counter() - t0) * 1000
        session.steps += 1
        return wire.encode({"op": "result", "id": h.get("id"), "server_ms": server_ms}, out, session.wire_dtype)

    async def reap(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, self.sessions.ttl_s))
            self.sessions.expire()


def create_app(server: MiddleServer) -> Starlette:
    async def health(_request: Any) -> JSONResponse:
        return JSONResponse(server.info())

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette):  # type: ignore[no-untyped-def]
        reaper = asyncio.create_task(server.reap())
        yield
        reaper.cancel()

    return Starlette(
        routes=[Route("/health", health), WebSocketRoute("/ws", server.handle)],
        lifespan=lifespan,
    )
