"""Frames of the client/server protocol: a small msgpack header plus raw tensor bytes.

Layout of one WebSocket binary message: 4-byte big-endian header length, msgpack map, payload.
This module frames any header; `messages` gives each kind of message its fields and checks them.
docs/protocol.md describes every field.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from splitllm.protocol.wire_dtypes import WIRE_DTYPE_NAMES

MAX_HEADER_BYTES = 1 << 20
WIRE_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in WIRE_DTYPE_NAMES}
_LEN = struct.Struct(">I")


class ProtocolError(Exception):
    """A request the server refuses; `code` is machine-readable and travels in the error frame."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Frame:
    header: dict[str, Any]
    payload: bytes = b""
    tensor: torch.Tensor | None = field(default=None, repr=False)


def encode(header: dict[str, Any], tensor: torch.Tensor | None = None, dtype: str | None = None) -> bytes:
    """Serialize a header and an optional 2-D tensor (cast to the wire dtype) into one message."""
    payload = b""
    if tensor is not None:
        wire = dtype or header.get("dtype", "float32")
        t = tensor.detach().to("cpu", WIRE_DTYPES[wire]).contiguous()
        header = {**header, "dtype": wire, "shape": list(t.shape)}
        payload = t.view(torch.uint8).numpy().tobytes()
    head = msgpack.packb(header, use_bin_type=True)
    return _LEN.pack(len(head)) + head + payload


def decode(message: bytes, max_header: int = MAX_HEADER_BYTES) -> Frame:
    """Parse one message; a tensor is materialized only if the header declares one and it fits."""
    if not isinstance(message, (bytes, bytearray, memoryview)):
        raise ProtocolError("bad_frame", "frames must be binary")
    message = bytes(message)
    if len(message) < _LEN.size:
        raise ProtocolError("bad_frame", "frame shorter than its 4-byte header length")
    (hlen,) = _LEN.unpack_from(message)
    if hlen > max_header or _LEN.size + hlen > len(message):
        raise ProtocolError("bad_frame", f"declared header length {hlen} does not fit the frame")
    try:
        header = msgpack.unpackb(message[_LEN.size : _LEN.size + hlen], raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ProtocolError("bad_frame", f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("op"), str):
        raise ProtocolError("bad_frame", "header must be a map with a string 'op'")
    payload = message[_LEN.size + hlen :]
    frame = Frame(header, payload)
    if "shape" in header:
        frame.tensor = _tensor(header, payload)
    elif payload:
        raise ProtocolError("bad_frame", "payload present but the header declares no tensor shape")
    return frame


def _tensor(header: dict[str, Any], payload: bytes) -> torch.Tensor:
    dtype_name, shape = header.get("dtype"), header.get("shape")
    if not isinstance(dtype_name, str) or dtype_name not in WIRE_DTYPES:
        raise ProtocolError("bad_dtype", f"wire dtype must be one of {', '.join(WIRE_DTYPES)}, got {dtype_name!r}")
    if (
        not isinstance(shape, list)
        or len(shape) != 2
        or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**31 for s in shape)
    ):
        raise ProtocolError("bad_shape", f"shape must be two integers in [0, 2**31), got {shape!r}")
    dtype = WIRE_DTYPES[dtype_name]
    expected = shape[0] * shape[1] * dtype.itemsize
    if expected != len(payload):
        raise ProtocolError("bad_shape", f"shape {shape} of {dtype_name} needs {expected} bytes, got {len(payload)}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(payload), dtype=dtype).view(shape[0], shape[1])

