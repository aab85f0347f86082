"""The HTTP layer in front of the app: hard limits on what a peer may send before it is authenticated.

uvicorn's h11 protocol, with three guards around it: the request head (request line plus headers)
is bounded in bytes by h11 itself (`max_head_bytes`), in lines here, and in time here: a connection
whose request head is not complete within `handshake_timeout_s` of its opening (or of its previous
response) is closed. So a slowloris peer holds a few KiB of buffer for a few seconds, never more.
httptools, which uvicorn prefers when installed, has no head size or count limit and no timer.

Under mutual TLS the client certificate's common name travels to the app in the connection's ASGI
state (`TLS_IDENTITY`), so the app can map certificate identities to principals.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


TLS_IDENTITY = "splitllm.tls_identity"


def common_name(cert: dict[str, Any] | None) -> str | None:
    """The subject common name of a certificate as `SSLObject.getpeercert()` gives it."""
    for rdn in (cert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


@dataclass(frozen=True)
class HeadLimits:
    """What a request head may cost: bytes (request line included), lines, and seconds to arrive."""

    max_head_bytes: int = 16 << 10
    max_head_lines: int = 64
    handshake_timeout_s: float = 10.0


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a line cap and a deadline on every request head.

    Made per connection by uvicorn: `GuardedH11Protocol.factory(limits)` is the `http=` argument.
    """

    limits = HeadLimits()

    @classmethod
    def factory(cls, limits: HeadLimits) -> type[GuardedH11Protocol]:
        return type(cls.__name__, (cls,), {"limits": limits})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_lines = 0
        self._head_tail = b""  # the last bytes seen, so a head's end split across reads is found
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        tls = transport.get_extra_info("ssl_object")
        identity = common_name(tls.getpeercert()) if tls is not None else None
        if identity is not None:  # every request of this connection, and its WebSocket, carry it
            self.app_state = {**self.app_state, TLS_IDENTITY: identity}
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._head_timer is not None:  # still reading a request head: count its lines only
            seen = self._head_tail + data
            end = seen.find(b"\r\n\r\n")
            self._head_lines += seen[: end + 4 if end >= 0 else len(seen)].count(b"\n") - self._head_tail.count(b"\n")
            self._head_tail = seen[-3:]
            if self._head_lines > self.limits.max_head_lines + 2:  # the request line and the blank line end
                self._refuse(431, b"request head has too many lines")
                return
        super().data_received(data)
        if self._head_timer is not None and self.conn.their_state is not h11.IDLE:
            self._disarm()  # the head is in: the app (or h11's own 400) takes it from here

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._disarm()
        super().handle_websocket_upgrade(event)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm()  # a kept-alive connection gets the same deadline for its next head

    def _arm(self) -> None:
        self._disarm()
        self._head_lines, self._head_tail = 0, b""
        self._head_timer = self.loop.call_later(self.limits.handshake_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _expire(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._refuse(408, b"request head not received in time")

    def _refuse(self, status: int, reason: bytes) -> None:
        """Answer without parsing further and hang up; the buffered bytes go with the connection."""
        self._disarm()
        body = reason + b"\n"
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: text/plain\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status, HTTPStatus(status).phrase.encode(), len(body), body)
        )
        self.transport.close()
