"""The server's middle layers seen from the client: one WebSocket, one session, one round trip a step."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

import torch
from websockets.sync.client import ClientConnection, connect

from splitllm import wire
from splitllm.stats import StepStats
from splitllm.visibility import Visibility


class ServerError(RuntimeError):
    """The server refused a request; `code` is the error frame's code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"server refused the request ({code}): {message}")
        self.code = code


class RemoteMiddle:
    """A session on a splitllm server holding layers [start, end) and their KV cache."""

    def __init__(
        self,
        url: str,
        fingerprint: str,
        layers: tuple[int, int],
        wire_dtype: str = "float16",
        max_context: int = 4096,
        open_timeout: float = 10.0,
    ) -> None:
        if wire_dtype not in wire.WIRE_DTYPES:
            raise ValueError(f"wire dtype must be one of {', '.join(wire.WIRE_DTYPES)}")
        self.url = url.rstrip("/") + ("" if url.rstrip("/").endswith("/ws") else "/ws")
        self.wire_dtype = wire_dtype
        self._ids = itertools.count(1)
        self._ws: ClientConnection = connect(self.url, compression=None, max_size=None, open_timeout=open_timeout)
        reply = self._call(
            {
                "op": "open",
                "version": wire.PROTOCOL_VERSION,
                "fingerprint": fingerprint,
                "layers": list(layers),
                "dtype": wire_dtype,
                "max_context": max_context,
            }
        )
        self.session: str = reply.header["session"]
        self.max_context: int = reply.header["max_context"]

    def _call(self, header: dict[str, Any], tensor: torch.Tensor | None = None) -> wire.Frame:
        self._ws.send(wire.encode({**header, "id": next(self._ids)}, tensor, self.wire_dtype))
        return self._check(wire.decode(self._ws.recv()))

    @staticmethod
    def _check(frame: wire.Frame) -> wire.Frame:
        if frame.header["op"] == "error":
            raise ServerError(str(frame.header.get("code")), str(frame.header.get("message")))
        return frame

    def step(
        self, hidden: torch.Tensor, positions: torch.Tensor, vis: Visibility, keep: Sequence[int], stats: StepStats
    ) -> torch.Tensor:
        """Send hidden states after the head, get them back before the tail; fills the wire timings."""
        t0 = time.perf_counter()
        header = {
            "op": "step",
            "id": next(self._ids),
            "session": self.session,
            "positions": positions.tolist(),
            "keep": list(keep),
            **vis.to_wire(),
        }
        message = wire.encode(header, hidden, self.wire_dtype)
        t1 = time.perf_counter()
        self._ws.send(message)
        reply = self._ws.recv()
        t2 = time.perf_counter()
        frame = self._check(wire.decode(reply))
        assert frame.tensor is not None
        out = frame.tensor.float()
        t3 = time.perf_counter()
        stats.serialize_ms += (t1 - t0) * 1000
        stats.round_trip_ms += (t2 - t1) * 1000
        stats.deserialize_ms += (t3 - t2) * 1000
        stats.server_ms += float(frame.header.get("server_ms", 0.0))
        stats.bytes_up += len(message)
        stats.bytes_down += len(reply)
        return out

    def close(self) -> None:
        try:
            self._call({"op": "close", "session": self.session})
        except Exception:
            pass  # closing is best effort: the server drops the session with the connection anyway
        self._ws.close()
