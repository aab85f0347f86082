"""Per-session KV caches: who may use them, how many may exist, and how much memory they may hold.

A session belongs to the principal and the connection that opened it; any other caller gets the
same `unknown_session` error as for an id that never existed, so ids cannot be probed. KV caches
are preallocated, so their bytes are reserved before allocation and a full server refuses new
sessions (retryably) instead of evicting active ones.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from splitllm.model.kv import KVCache
from splitllm.server.logs import event, session_tag
from splitllm.protocol.wire import ProtocolError

# Codes a client should retry after a pause: capacity, not a fault in its request.
RETRYABLE_CODES = frozenset({"server_full", "principal_full"})
_TOMBSTONES = 1024  # expired ids remembered so their owners learn why (bounded: oldest forgotten first)


@dataclass
class Session:
    id: str
    principal: str
    connection: int
    cache: KVCache
    wire_dtype: str
    kv_bytes: int
    last_used: float = field(default_factory=time.monotonic)
    steps: int = 0


class SessionStore:
    """Sessions by id, under a cap on their number (in total and per principal) and on KV bytes.

    The event loop (open/close/expiry) and the compute thread (steps) both use it, hence the lock.
    """

    def __init__(
        self,
        max_sessions: int,
        ttl_s: float,
        max_per_principal: int | None = None,
        max_kv_bytes: int | None = None,
    ) -> None:
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.max_per_principal = max_per_principal or max_sessions
        self.max_kv_bytes = max_kv_bytes
        self._sessions: dict[str, Session] = {}
        self._expired: OrderedDict[str, tuple[int, str]] = OrderedDict()
        self._reserved = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def kv_bytes(self) -> int:
        """KV bytes reserved by open sessions (and by sessions being allocated right now)."""
        return self._reserved

    def count(self, principal: str) -> int:
        """Open sessions of one principal."""
        with self._lock:
            return sum(s.principal == principal for s in self._sessions.values())

    def kv_bytes_of(self, principal: str) -> int:
        """KV bytes reserved by one principal's open sessions."""
        with self._lock:
            return sum(s.kv_bytes for s in self._sessions.values() if s.principal == principal)

    def open(
        self, connection: int, principal: str, kv_bytes: int, make_cache: Callable[[], KVCache], wire_dtype: str
    ) -> Session:
        """Reserve room for a session, then allocate its cache; refuses when any bound would be crossed."""
        self.expire()
        with self._lock:
            self._admit(principal, kv_bytes)
            self._reserved += kv_bytes
        try:
            cache = make_cache()
        except BaseException:
            with self._lock:
                self._reserved -= kv_bytes
            raise
        session = Session(secrets.token_urlsafe(18), principal, connection, cache, wire_dtype, kv_bytes)
        with self._lock:
            self._sessions[session.id] = session
        event(
            "session_opened", session=session_tag(session.id), principal=principal, connection=connection,
            max_context=cache.max_context, kv_bytes=kv_bytes,
        )
        return session

    def _admit(self, principal: str, kv_bytes: int) -> None:
        if self.max_kv_bytes is not None and kv_bytes > self.max_kv_bytes:
            raise ProtocolError(
                "context_too_large",
                f"a session of this max_context needs {kv_bytes} bytes of KV cache, more than the server's "
                f"bound of {self.max_kv_bytes}; ask for a shorter max_context",
            )
        if len(self._sessions) >= self.max_sessions:
            raise ProtocolError("server_full", f"server holds its maximum of {self.max_sessions} sessions; retry later")
        if sum(s.principal == principal for s in self._sessions.values()) >= self.max_per_principal:
            raise ProtocolError(
                "principal_full",
                f"{principal} holds its maximum of {self.max_per_principal} sessions; close one or retry later",
            )
        if self.max_kv_bytes is not None and self._reserved + kv_bytes > self.max_kv_bytes:
            raise ProtocolError(
                "server_full",
                f"KV cache memory is taken ({self._reserved} of {self.max_kv_bytes} bytes); retry later "
                "or ask for a shorter max_context",
            )

    def get(self, session_id: str, connection: int, principal: str) -> Session:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or session.connection != connection or session.principal != principal:
                if self._expired.get(session_id) == (connection, principal):
                    raise ProtocolError("session_expired",
                                        f"session expired after {self.ttl_s:g} s idle; open a new one")
                raise ProtocolError("unknown_session", "no such session on this connection")
            session.last_used = time.monotonic()
            return session

    def close(self, session_id: str, reason: str) -> None:
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is None:
                return
            self._reserved -= session.kv_bytes
            if reason == "idle":
                self._expired[session_id] = (session.connection, session.principal)
                while len(self._expired) > _TOMBSTONES:
                    self._expired.popitem(last=False)
        event("session_closed", session=session_tag(session_id), reason=reason, steps=session.steps)

    def close_connection(self, connection: int) -> None:
        with self._lock:
            ids = [s.id for s in self._sessions.values() if s.connection == connection]
            for sid in [sid for sid, (conn, _) in self._expired.items() if conn == connection]:
                del self._expired[sid]
        for sid in ids:
            self.close(sid, "connection ended")

    def expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            ids = [s.id for s in self._sessions.values() if now - s.last_used > self.ttl_s]
        for sid in ids:
            self.close(sid, "idle")
