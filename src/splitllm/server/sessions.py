"""Per-session KV caches with an idle TTL and a cap on how many exist at once."""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field

from splitllm.kv import KVCache
from splitllm.wire import ProtocolError

log = logging.getLogger("splitllm.server")


@dataclass
class Session:
    id: str
    connection: int
    cache: KVCache
    wire_dtype: str
    last_used: float = field(default_factory=time.monotonic)
    steps: int = 0


class SessionStore:
    """Sessions by id; a session is reachable only from the connection that opened it."""

    def __init__(self, max_sessions: int, ttl_s: float) -> None:
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def kv_bytes(self) -> int:
        return sum(s.cache.nbytes for s in self._sessions.values())

    def open(self, connection: int, cache: KVCache, wire_dtype: str) -> Session:
        self.expire()
        if len(self._sessions) >= self.max_sessions:
            raise ProtocolError("server_full", f"server holds its maximum of {self.max_sessions} sessions; retry later")
        session = Session(secrets.token_urlsafe(18), connection, cache, wire_dtype)
        self._sessions[session.id] = session
        log.info("session %s opened (max_context=%d)", session.id[:8], cache.max_context)
        return session

    def get(self, session_id: object, connection: int) -> Session:
        session = self._sessions.get(session_id) if isinstance(session_id, str) else None
        if session is None or session.connection != connection:
            raise ProtocolError("unknown_session", "no such session on this connection")
        session.last_used = time.monotonic()
        return session

    def close(self, session_id: str, reason: str) -> None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
            log.info("session %s closed (%s) after %d steps", session_id[:8], reason, session.steps)

    def close_connection(self, connection: int) -> None:
        for sid in [s.id for s in self._sessions.values() if s.connection == connection]:
            self.close(sid, "connection ended")

    def expire(self) -> None:
        now = time.monotonic()
        for sid in [s.id for s in self._sessions.values() if now - s.last_used > self.ttl_s]:
            self.close(sid, "idle")
