"""How a server listens: uvicorn settings for TLS (1.2 or later, optionally mutual), request heads, frames.

Requests go through h11 with the guards of `http_guard` (never httptools, which bounds nothing).
The WebSocket layer (websockets' parser inside uvicorn) reads a frame's declared length before its
payload and refuses anything above `ws_max_size` with close code 1009, so an oversized frame is
never buffered. Connection caps live in the app, which knows the principal: uvicorn's own
`limit_concurrency` would answer health probes 503 and let WebSockets past.
"""

from __future__ import annotations

import ipaddress
import ssl
from dataclasses import dataclass

import uvicorn

from splitllm.server.app import MiddleServer, create_app
from splitllm.server.http_guard import GuardedH11Protocol, HeadLimits


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: the server's certificate chain and key; `client_ca` turns on mutual TLS."""

    cert: str
    key: str
    client_ca: str | None = None

    def __post_init__(self) -> None:
        """Load the files once now, so a wrong path or a bad PEM stops a server before its model loads."""
        try:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(self.cert, self.key)
            if self.client_ca:
                ctx.load_verify_locations(self.client_ca)
        except OSError as exc:  # ssl.SSLError included
            ca = f", --client-ca {self.client_ca}" if self.client_ca else ""
            raise ValueError(
                f"the TLS files do not load (--tls-cert {self.cert}, --tls-key {self.key}{ca}): {exc}"
            ) from None


def is_loopback(host: str) -> bool:
    """Whether a listening address is reachable from this machine only."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def uvicorn_config(server: MiddleServer, host: str, port: int, tls: TlsFiles | None = None) -> uvicorn.Config:
    settings = server.settings
    tls_options: dict[str, object] = {}
    if tls is not None:
        tls_options = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
        if tls.client_ca:
            tls_options.update(ssl_ca_certs=tls.client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    config = uvicorn.Config(
        create_app(server),
        host=host,
        port=port,
        http=GuardedH11Protocol.factory(
            HeadLimits(settings.max_header_bytes, settings.max_header_lines, settings.handshake_timeout_s)
        ),
        h11_max_incomplete_event_size=settings.max_header_bytes,
        ws_max_size=settings.max_frame_bytes,
        ws_per_message_deflate=False,  # hidden states do not compress, and inflating is a memory bomb
        log_level="warning",
        **tls_options,  # type: ignore[arg-type]
    )
    if tls is not None:
        config.load()  # builds the SSL context, which uvicorn.Server then uses as is
        assert config.ssl is not None
        config.ssl.minimum_version = ssl.TLSVersion.TLSv1_2
        # No TLS 1.3 session tickets: websockets' sync client reads its TLS socket on one thread while
        # it writes the upgrade request on another, and a ticket arriving in between can wedge the
        # handshake (seen about once in a thousand). Resumption would only save a certificate check.
        config.ssl.num_tickets = 0
    return config
