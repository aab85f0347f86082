"""Bearer-token authentication at the WebSocket handshake.

The token file holds one `principal:token` per line (blank lines and `#` comments ignored). Only
SHA-256 digests of the tokens stay in memory, and a presented token is compared against every
entry in constant time, so neither timing nor a memory dump gives a token away.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

ANONYMOUS = "anonymous"


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TokenTable:
    """Principals and the digests of their tokens."""

    def __init__(self, entries: dict[str, str]) -> None:
        if not entries:
            raise ValueError("a token table needs at least one principal:token entry")
        self._digests = [(principal, _digest(token)) for principal, token in entries.items()]

    @classmethod
    def load(cls, path: str | Path) -> TokenTable:
        entries: dict[str, str] = {}
        for number, raw in enumerate(Path(path).read_text().splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            principal, sep, token = line.partition(":")
            principal, token = principal.strip(), token.strip()
            if not sep or not principal or not token:
                raise ValueError(f"{path}:{number}: expected 'principal:token'")
            if principal in entries:
                raise ValueError(f"{path}:{number}: principal {principal!r} appears twice")
            entries[principal] = token
        return cls(entries)

    def principal(self, authorization: str | None) -> str | None:
        """The principal an `Authorization: Bearer <token>` header proves, or None."""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        presented = _digest(token.strip())
        found = None
        for principal, digest in self._digests:  # no early exit: every entry costs the same
            if hmac.compare_digest(presented, digest):
                found = principal
        return found
