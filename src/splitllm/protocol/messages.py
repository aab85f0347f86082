"""The messages of a session, one frozen dataclass per kind, checked once where a frame is received.

`wire` frames a header map and a tensor; this module gives every kind its typed fields, so the rest of
the code reads attributes, never header keys. `decode` checks a received frame whole (its kind,
required fields, types, and every range that needs no server state) and raises `ProtocolError` with
the code docs/protocol.md lists; `encode` writes a message as a frame. What needs the server's state
(the session, its dtype and context, the model's width and positions) the server checks after.

The attestation handshake (`attest`, `evidence`) keeps its own messages: attestation/handshake.py
builds and reads them, framed by `wire` like these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, TypeAlias, TypeGuard, TypeVar, cast

import torch

from splitllm.protocol import wire
from splitllm.protocol.wire import WIRE_DTYPES, ProtocolError

# 2: the attestation handshake and sealed frames; 3: every message checked whole on receipt; 4: a step may
# crop the cache (undoing a step sent ahead on a guess that failed); 5: evidence binds the loaded-weights
# fingerprint
PROTOCOL_VERSION = 5
RequestId: TypeAlias = int | str | None  # echoed by the reply; an id of another type counts as none
_INT64 = 2**63


@dataclass(frozen=True)
class OpenMessage:
    """A session for these weights and this split, stepping in `dtype`; `max_context` None: the server's."""

    OP: ClassVar[str] = "open"
    fingerprint: str
    layers: tuple[int, int]
    dtype: str
    max_context: int | None = None
    version: int = PROTOCOL_VERSION
    id: RequestId = None

    def header(self) -> dict[str, Any]:
        h: dict[str, Any] = {"op": self.OP, "version": self.version, "fingerprint": self.fingerprint,
                             "layers": list(self.layers), "dtype": self.dtype}
        if self.max_context is not None:
            h["max_context"] = self.max_context
        return h | {"id": self.id}

    @classmethod
    def parse(cls, frame: wire.Frame) -> OpenMessage:
        """The version first: a client of another release learns that before anything else."""
        h = frame.header
        version = check_version(h.get("version"))
        fingerprint = h.get("fingerprint")
        if not isinstance(fingerprint, str):
            raise ProtocolError("model_mismatch", "open carries no model fingerprint (64 hex characters)")
        layers = h.get("layers")
        if not isinstance(layers, list) or len(layers) != 2 or not all(_is_int(x) for x in layers):
            raise ProtocolError("split_mismatch", f"layers must be [start, end], got {layers!r:.60}")
        dtype = h.get("dtype")
        if not isinstance(dtype, str) or dtype not in WIRE_DTYPES:
            raise ProtocolError("bad_dtype", f"wire dtype must be one of {', '.join(WIRE_DTYPES)}")
        max_context = _count(h, "max_context") if "max_context" in h else None
        return cls(fingerprint, (layers[0], layers[1]), dtype, max_context, version, request_id(frame))


@dataclass(frozen=True)
class OpenedMessage:
    """The session's id, the context it was granted, the most positions one step may carry, and whether the
    server's layers give a row the same bits in any step (absent: they do), which speculation needs."""

    OP: ClassVar[str] = "opened"
    session: str
    max_context: int
    max_nodes: int
    id: RequestId = None
    row_invariant: bool = True

    def header(self) -> dict[str, Any]:
        return {"op": self.OP, "id": self.id, "session": self.session, "max_context": self.max_context,
                "max_nodes": self.max_nodes, "row_invariant": self.row_invariant}

    @classmethod
    def parse(cls, frame: wire.Frame) -> OpenedMessage:
        h = frame.header
        invariant = h.get("row_invariant", True)
        if not isinstance(invariant, bool):
            raise ProtocolError("bad_request", "row_invariant must be true or false")
        return cls(_text(h, "session"), _count(h, "max_context"), _count(h, "max_nodes"), request_id(frame), invariant)


@dataclass(frozen=True)
class StepMessage:
    """One step of a session: `hidden` (n, d) in the wire `dtype`, their positions, the committed length
    to `crop` the cache back to first (None: none), the previous step's entries to `keep`, and how the new
    entries see each other (`parents`, else `bits`, else a chain)."""

    OP: ClassVar[str] = "step"
    session: str
    hidden: torch.Tensor
    dtype: str
    positions: tuple[int, ...]
    keep: tuple[int, ...] = ()
    parents: tuple[int, ...] | None = None
    bits: bytes | None = None
    id: RequestId = None
    crop: int | None = None

    def header(self) -> dict[str, Any]:
        h: dict[str, Any] = {"op": self.OP, "id": self.id, "session": self.session, "keep": list(self.keep),
                             "positions": list(self.positions)}
        if self.crop is not None:
            h["crop"] = self.crop
        if self.parents is not None:
            h["parents"] = list(self.parents)
        elif self.bits is not None:
            h["bits"] = self.bits
        return h

    @classmethod
    def parse(cls, frame: wire.Frame) -> StepMessage:
        h, hidden = frame.header, frame.tensor
        session = h.get("session")
        if not isinstance(session, str):
            raise ProtocolError("unknown_session", "no such session on this connection")
        if hidden is None:
            raise ProtocolError("bad_shape", "a step carries hidden states")
        n = hidden.shape[0]
        positions = h.get("positions")
        if not isinstance(positions, list) or len(positions) != n or not all(_is_int(p) for p in positions):
            raise ProtocolError("bad_positions", f"positions must be a list of {n} integers")
        if not all(-_INT64 <= p < _INT64 for p in positions):
            raise ProtocolError("bad_request", "positions must be 64-bit integers")
        keep = h.get("keep", [])
        if not isinstance(keep, list):
            raise ProtocolError("bad_keep", "keep must be a list of indices")
        for earlier, k in zip([-1, *keep], keep):
            if not _is_int(k) or k <= earlier:
                raise ProtocolError("bad_request", "keep must be strictly increasing indices into the previous step")
        crop = h.get("crop")
        if crop is not None and (not _is_int(crop) or not 0 <= crop < _INT64):
            raise ProtocolError("bad_request", "crop must be a committed length (an integer >= 0)")
        if crop is not None and keep:
            raise ProtocolError("bad_keep", "a step that crops the cache keeps nothing of the previous step")
        parents, bits = _visibility(h, n)
        if not bool(torch.isfinite(hidden).all()):
            raise ProtocolError("bad_values", "hidden states contain NaN or Inf")
        return cls(session, hidden, h["dtype"], tuple(positions), tuple(keep), parents, bits, request_id(frame), crop)


@dataclass(frozen=True)
class ResultMessage:
    """The step's output `hidden` (n, d) in the session's wire `dtype`, and the server's compute time."""

    OP: ClassVar[str] = "result"
    hidden: torch.Tensor
    dtype: str
    server_ms: float
    id: RequestId = None

    def header(self) -> dict[str, Any]:
        return {"op": self.OP, "id": self.id, "server_ms": self.server_ms}

    @classmethod
    def parse(cls, frame: wire.Frame) -> ResultMessage:
        h = frame.header
        if frame.tensor is None:
            raise ProtocolError("bad_shape", "a result carries hidden states")
        server_ms = h.get("server_ms")
        if not isinstance(server_ms, (int, float)) or isinstance(server_ms, bool):
            raise ProtocolError("bad_request", "server_ms must be a number")
        return cls(frame.tensor, h["dtype"], float(server_ms), request_id(frame))


@dataclass(frozen=True)
class CloseMessage:
    """Free the session's cache."""

    OP: ClassVar[str] = "close"
    session: str
    id: RequestId = None

    def header(self) -> dict[str, Any]:
        return {"op": self.OP, "session": self.session, "id": self.id}

    @classmethod
    def parse(cls, frame: wire.Frame) -> CloseMessage:
        session = frame.header.get("session")
        if not isinstance(session, str):
            raise ProtocolError("unknown_session", "no such session on this connection")
        return cls(session, request_id(frame))


@dataclass(frozen=True)
class ClosedMessage:
    """The session is gone."""

    OP: ClassVar[str] = "closed"
    id: RequestId = None

    def header(self) -> dict[str, Any]:
        return {"op": self.OP, "id": self.id}

    @classmethod
    def parse(cls, frame: wire.Frame) -> ClosedMessage:
        return cls(request_id(frame))


@dataclass(frozen=True)
class ErrorMessage:
    """A refused request: `code` for programs, `message` for people; `retryable`: the request was fine
    but the server lacks room now, so the same request may succeed later."""

    OP: ClassVar[str] = "error"
    code: str
    message: str
    retryable: bool = False
    id: RequestId = None

    def header(self) -> dict[str, Any]:
        h = {"op": self.OP, "id": self.id, "code": self.code, "message": self.message}
        return h | {"retryable": True} if self.retryable else h

    @classmethod
    def parse(cls, frame: wire.Frame) -> ErrorMessage:
        h = frame.header
        retryable = h.get("retryable", False)
        if not isinstance(retryable, bool):
            raise ProtocolError("bad_request", "retryable must be true or false")
        return cls(_text(h, "code"), _text(h, "message"), retryable, request_id(frame))


Request: TypeAlias = OpenMessage | StepMessage | CloseMessage
Reply: TypeAlias = OpenedMessage | ResultMessage | ClosedMessage | ErrorMessage
Message: TypeAlias = Request | Reply
_M = TypeVar("_M", bound=Message)
REQUESTS: tuple[type[Request], ...] = (OpenMessage, StepMessage, CloseMessage)  # what a server accepts
REPLIES: tuple[type[Reply], ...] = (OpenedMessage, ResultMessage, ClosedMessage, ErrorMessage)  # what a client accepts


def encode(message: Message) -> bytes:
    """The frame of `message`; hidden states travel cast to the message's wire dtype."""
    if isinstance(message, (StepMessage, ResultMessage)):
        return wire.encode(message.header(), message.hidden, message.dtype)
    return wire.encode(message.header())


def decode(data: bytes, kinds: tuple[type[_M], ...]) -> _M:
    """The message in a received frame, one of `kinds`; ProtocolError if the frame or the message is malformed."""
    return parse(wire.decode(data), kinds)


def parse(frame: wire.Frame, kinds: tuple[type[_M], ...]) -> _M:
    """The message a framed header holds, one of `kinds` (another op is `unknown_op`); fields not
    listed for its kind are ignored."""
    op = frame.header["op"]
    for kind in kinds:
        if kind.OP == op:
            return cast(_M, kind.parse(frame))
    raise ProtocolError("unknown_op", f"unknown op {op!r}; expected {', '.join(k.OP for k in kinds)}")


def check_version(version: object) -> int:
    """The version a client's first message names, if it is this one; a refusal naming both otherwise."""
    if version != PROTOCOL_VERSION:
        theirs = "names no version" if version is None else f"speaks protocol {version!r:.20}"
        raise ProtocolError(
            "version_mismatch",
            f"this server speaks protocol {PROTOCOL_VERSION} and the client {theirs}: "
            "use a client and a server of the same splitllm release",
        )
    return PROTOCOL_VERSION


def request_id(frame: wire.Frame) -> RequestId:
    """The id a reply to this frame echoes: the header's, if it is an integer or a string."""
    rid = frame.header.get("id")
    return rid if isinstance(rid, (int, str)) else None


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _text(h: dict[str, Any], key: str) -> str:
    value = h.get(key)
    if not isinstance(value, str):
        raise ProtocolError("bad_request", f"{key} must be a string")
    return value


def _count(h: dict[str, Any], key: str) -> int:
    value = h.get(key)
    if not _is_int(value) or value < 1:
        raise ProtocolError("bad_request", f"{key} must be a positive integer")
    return value


def _visibility(h: dict[str, Any], n: int) -> tuple[tuple[int, ...] | None, bytes | None]:
    """(parents, bits) of a step of n entries: `parents` wins when both are present; neither is a chain.
    Only their form is checked here: unpacking bits is left until the server has bounded the step's size."""
    if "parents" in h:
        parents = h["parents"]
        if not isinstance(parents, list) or len(parents) != n:
            raise ProtocolError("bad_request", f"parents must be a list of {n} indices")
        for i, p in enumerate(parents):
            if not _is_int(p) or not -1 <= p < i:
                raise ProtocolError("bad_request", f"parent of node {i} must be an earlier node or -1, got {p!r:.20}")
        return tuple(parents), None
    bits = h.get("bits")
    if bits is None:
        return None, None
    if not isinstance(bits, bytes) or len(bits) != (n * n + 7) // 8:
        raise ProtocolError("bad_request", f"visibility bits must be {(n * n + 7) // 8} bytes for {n} positions")
    return None, bits
