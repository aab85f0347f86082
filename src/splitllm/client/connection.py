"""Reaching a server: TLS trust, the bearer token, timeouts, and the errors a caller can act on.

Errors fall in two kinds. Refusals (`ServerError`, `AuthenticationError`, certificate failures) are
final: retrying cannot help. Link failures (refused or reset connections, timeouts, a server
restarting, a full server) are transient: `RemoteMiddle` reconnects until its deadline, then raises
`ServerUnreachable`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidMessage, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from splitllm.attestation.policy import AttestationPolicy
from splitllm.attestation.sealing import SealError
from splitllm.attestation.verify import AttestationError

TOKEN_ENV = "SPLITLLM_TOKEN"
# Codes after which the session is gone but a new one can take over (the client replays into it).
_SESSION_LOST = frozenset({"session_expired", "unknown_session"})

log = logging.getLogger("splitllm.client")


class ServerError(RuntimeError):
    """The server refused a request; `code` is the error frame's code, `retryable` its hint to try later."""

    def __init__(self, code: str, message: str, retryable: bool = False) -> None:
        super().__init__(f"server refused the request ({code}): {message}")
        self.code = code
        self.retryable = retryable


class AuthenticationError(ServerError):
    """The server refused the handshake (HTTP 403, or 401): a missing, wrong or revoked token."""

    def __init__(self, message: str) -> None:
        RuntimeError.__init__(self, f"authentication failed: {message}")
        self.code, self.retryable = "unauthenticated", False


class ServerUnreachable(ConnectionError):
    """No server could be reached within the deadline.

    `SplitClient.generate` sets `generation` to the generation so far (its tokens stay usable).
    """

    generation: object = None


# What a generation can fail with that a caller reports and goes on from: bad input, a refusing or
# unreachable server, a server that fails attestation, a sealed frame refused.
CLIENT_ERRORS: tuple[type[Exception], ...] = (ValueError, ServerError, OSError, AttestationError, SealError)


def read_token(token_file: str | os.PathLike | None = None) -> str | None:
    """The bearer token from a file (its only content) or else from $SPLITLLM_TOKEN; None if neither."""
    if token_file is not None:
        token = Path(token_file).expanduser().read_text().strip()
        if not token:
            raise ValueError(f"token file {token_file} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def is_transient(exc: BaseException) -> bool:
    """Whether reconnecting (and replaying into a new session) may get past this error."""
    if isinstance(exc, ServerError):
        return exc.retryable or exc.code in _SESSION_LOST
    if isinstance(exc, ssl.SSLCertVerificationError):
        return False  # the server's certificate is not trusted: a configuration error
    return isinstance(exc, (ConnectionClosed, InvalidHandshake, OSError, EOFError))


class _Connection(ClientConnection):
    """websockets' sync connection, with a socket close that always wakes its reader thread.

    Over TLS the reader can sit in a blocking read inside a record after select() said "readable";
    closing the descriptor does not wake it (nor send a FIN), so a refused handshake could wait on
    that thread forever. Shutting the socket down first does.
    """

    def close_socket(self) -> None:
        with contextlib.suppress(OSError):
            self.socket.shutdown(socket.SHUT_RDWR)
        super().close_socket()


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, kw_only=True)
class ConnectionOptions:
    """How to reach servers.

    ca_file: PEM bundle trusted for the server's certificate (a self-signed setup's CA); default: system CAs.
    insecure: accept any server certificate (encrypts, but proves nothing: for tests only).
    client_cert / client_key: a certificate for servers that require mutual TLS.
    attestation: the policy a confidential server's evidence must meet (docs/confidential.md); without
      one the server's operator can read every hidden state the client sends.
    fallbacks: further server URLs, tried in turn when the current one is unreachable.
    deadline_s: how long to keep trying to reach a server after the link fails (or at start).
    step_timeout_s: longest wait for one reply before the link is considered dead.
    """

    token: str | None = None
    ca_file: str | None = None
    insecure: bool = False
    client_cert: str | None = None
    client_key: str | None = None
    fallbacks: tuple[str, ...] = ()
    open_timeout_s: float = 10.0
    step_timeout_s: float = 300.0
    deadline_s: float = 60.0
    max_frame_bytes: int = 256 << 20
    # verify a confidential server before sending anything; seal every frame
    attestation: AttestationPolicy | None = None

    def __post_init__(self) -> None:
        """Load the TLS files once now: a wrong path or a bad PEM is a setting to fix, not a link to retry."""
        if self.ca_file or self.client_cert:
            try:
                self.ssl_context()
            except OSError as exc:  # ssl.SSLError included
                given = (("--ca", self.ca_file), ("--client-cert", self.client_cert), ("--client-key", self.client_key))
                files = ", ".join(f"{flag} {path}" for flag, path in given if path)
                raise ValueError(f"the TLS files do not load ({files}): {exc}") from None

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if self.insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.client_cert:
            ctx.load_cert_chain(self.client_cert, self.client_key)
        return ctx

    def connect(self, url: str) -> ClientConnection:
        """Open a WebSocket to `url` with the token and TLS settings; AuthenticationError if refused."""
        secure = url.startswith("wss://")
        if self.token and not secure and not _is_loopback(url):
            log.warning("sending a bearer token over unencrypted %s; use wss:// or an SSH tunnel", url)
        try:
            return connect(
                url,
                ssl=self.ssl_context() if secure else None,
                additional_headers={"Authorization": f"Bearer {self.token}"} if self.token else None,
                compression=None,
                max_size=self.max_frame_bytes,
                open_timeout=self.open_timeout_s,
                close_timeout=1.0,
                create_connection=_Connection,
                legacy=True,  # a connection that outlives this call (websockets >= 17.1)
            )
        except InvalidStatus as exc:
            status = exc.response.status_code
            if status in (401, 403):
                why = "no token given" if not self.token else "the server does not accept this token"
                raise AuthenticationError(f"{url} answered HTTP {status} ({why})") from None
            if status in (429,) or status >= 500:
                raise  # busy or restarting: transient
            raise ServerError("handshake_refused", f"{url} answered HTTP {status}") from None
        except (ConnectionClosed, InvalidMessage, EOFError) as exc:
            # A TLS server refuses a client certificate by hanging up, not with an HTTP status.
            raise ConnectionError(
                f"{url} hung up during the handshake: it is restarting, or it requires a client "
                "certificate (mutual TLS) it did not get or does not trust"
            ) from exc
