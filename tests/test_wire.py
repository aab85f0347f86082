"""The frame format: layout, tensor round trips per dtype, and a clear ProtocolError for every
malformed frame (never an unrelated exception); the typed messages: round trips, the header they
write, and a refusal on receipt, with its code, for every malformed request."""

from __future__ import annotations

import struct
from dataclasses import replace

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitllm.protocol import messages, wire
from splitllm.protocol.messages import (
    CloseMessage, ClosedMessage, ErrorMessage, OpenedMessage, OpenMessage, ResultMessage, StepMessage,
)
from splitllm.protocol.wire import ProtocolError


def _raw(header: object, payload: bytes = b"") -> bytes:
    head = msgpack.packb(header, use_bin_type=True)
    return struct.pack(">I", len(head)) + head + payload


def test_layout_is_length_header_payload() -> None:
    t = torch.arange(6, dtype=torch.float32).view(2, 3)
    message = wire.encode({"op": "step", "id": 7}, t, "float32")
    (hlen,) = struct.unpack(">I", message[:4])
    header = msgpack.unpackb(message[4 : 4 + hlen])
    assert header == {"op": "step", "id": 7, "dtype": "float32", "shape": [2, 3]}
    assert message[4 + hlen :] == t.numpy().astype("<f4").tobytes()


@pytest.mark.parametrize("dtype", list(wire.WIRE_DTYPES))
@pytest.mark.parametrize("shape", [(1, 576), (5, 64), (0, 576)])
def test_tensor_round_trip(dtype: str, shape: tuple[int, int]) -> None:
    t = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    frame = wire.decode(wire.encode({"op": "result"}, t, dtype))
    assert frame.tensor is not None
    assert frame.tensor.dtype == wire.WIRE_DTYPES[dtype] and tuple(frame.tensor.shape) == shape
    assert torch.equal(frame.tensor, t.to(wire.WIRE_DTYPES[dtype]))
    frame.tensor += 1  # decoded tensors own writable memory


def test_header_dtype_is_the_default_wire_dtype() -> None:
    frame = wire.decode(wire.encode({"op": "step", "dtype": "float16"}, torch.ones(2, 2)))
    assert frame.tensor is not None and frame.tensor.dtype == torch.float16


def test_frame_without_tensor() -> None:
    frame = wire.decode(wire.encode({"op": "open", "layers": [2, 28]}))
    assert frame.header == {"op": "open", "layers": [2, 28]} and frame.tensor is None and frame.payload == b""


_headers = st.dictionaries(
    st.text(max_size=8).filter(lambda k: k not in ("op", "shape", "dtype")),
    st.one_of(
        st.integers(-(2**63), 2**64 - 1),
        st.text(max_size=20),
        st.binary(max_size=20),
        st.lists(st.integers(-(2**63), 2**63 - 1), max_size=5),
    ),
    max_size=6,
)


@settings(max_examples=100, deadline=None)
@given(_headers, st.integers(0, 4), st.sampled_from(list(wire.WIRE_DTYPES)))
def test_any_header_round_trips(header: dict, rows: int, dtype: str) -> None:
    t = torch.full((rows, 3), 0.5)
    frame = wire.decode(wire.encode({"op": "x", **header}, t, dtype))
    assert frame.header == {"op": "x", **header, "dtype": dtype, "shape": [rows, 3]}


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("text", "bad_frame"),
        (b"\x00\x00", "bad_frame"),
        (struct.pack(">I", 100) + b"\x80", "bad_frame"),
        (struct.pack(">I", wire.MAX_HEADER_BYTES + 1) + bytes(16), "bad_frame"),
        (struct.pack(">I", 3) + b"\xc1\xc1\xc1", "bad_frame"),
        (_raw([1, 2]), "bad_frame"),
        (_raw({"id": 1}), "bad_frame"),
        (_raw({"op": 3}), "bad_frame"),
        (_raw({1: "op"}), "bad_frame"),
        (_raw({"op": "step"}, b"\x00" * 8), "bad_frame"),
        (_raw({"op": "step", "dtype": "int8", "shape": [1, 1]}, b"\x00"), "bad_dtype"),
        (_raw({"op": "step", "shape": [1, 1]}, b"\x00" * 4), "bad_dtype"),
        (_raw({"op": "step", "dtype": "float32", "shape": [1, 1, 1]}, b"\x00" * 4), "bad_shape"),
        (_raw({"op": "step", "dtype": "float32", "shape": [-1, 1]}, b""), "bad_shape"),
        (_raw({"op": "step", "dtype": "float32", "shape": [True, 1]}, b"\x00" * 4), "bad_shape"),
        (_raw({"op": "step", "dtype": "float32", "shape": "1x1"}, b"\x00" * 4), "bad_shape"),
        (_raw({"op": "step", "dtype": "float32", "shape": [2, 2]}, b"\x00" * 15), "bad_shape"),
        (_raw({"op": "step", "dtype": "float16", "shape": [2, 2]}, b"\x00" * 16), "bad_shape"),
    ],
)
def test_malformed_frames_raise_protocol_errors(message: object, code: str) -> None:
    with pytest.raises(ProtocolError) as info:
        wire.decode(message)  # type: ignore[arg-type]
    assert info.value.code == code and info.value.message


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_never_raises_anything_but_protocol_error(data: bytes) -> None:
    try:
        wire.decode(data)
    except ProtocolError:
        pass


def test_truncated_step_frame() -> None:
    message = wire.encode({"op": "step", "id": 1}, torch.ones(3, 8), "float32")
    for cut in (1, 4, len(message) - 96, len(message) - 1):
        with pytest.raises(ProtocolError):
            wire.decode(message[:cut])


@pytest.mark.parametrize(("rid", "echoed"), [(5, 5), ("a", "a"), (None, None), ([1], None), (1.5, None)])
def test_a_reply_echoes_only_an_integer_or_string_id(rid: object, echoed: object) -> None:
    request = messages.decode(wire.encode({"op": "close", "id": rid, "session": "s"}), messages.REQUESTS)
    assert request == CloseMessage("s", echoed)
    frame = wire.decode(messages.encode(ErrorMessage("bad_request", "nope", id=request.id)))
    assert frame.header == {"op": "error", "id": echoed, "code": "bad_request", "message": "nope"}


# --- typed messages --------------------------------------------------------------------------------------

_HIDDEN = torch.arange(6, dtype=torch.float32).view(2, 3)


@pytest.mark.parametrize(
    "message",
    [
        OpenMessage("ab" * 32, (2, 28), "float16", 512, id=1),
        OpenMessage("ab" * 32, (2, 28), "float32"),
        OpenedMessage("s" * 24, 512, 256, 1),
        OpenedMessage("s" * 24, 512, 256, row_invariant=False),
        StepMessage("s", _HIDDEN, "float32", (0, 1), (0, 2), parents=(-1, 0), id=7),
        StepMessage("s", _HIDDEN, "float32", (4, 4), bits=b"\xd0", id="x"),
        StepMessage("s", _HIDDEN, "float32", (0, 1)),
        ResultMessage(_HIDDEN, "float32", 1.5, 7),
        CloseMessage("s", 3),
        ClosedMessage(3),
        ErrorMessage("server_full", "later", True, 2),
        ErrorMessage("bad_request", "no"),
    ],
    ids=lambda m: type(m).__name__,
)
def test_every_message_round_trips(message: messages.Message) -> None:
    got = messages.decode(messages.encode(message), messages.REQUESTS + messages.REPLIES)
    if isinstance(message, (StepMessage, ResultMessage)):
        assert isinstance(got, type(message)) and torch.equal(got.hidden, message.hidden)
        assert replace(got, hidden=message.hidden) == message  # type: ignore[type-var]
    else:
        assert got == message


def test_an_opened_reply_without_row_invariance_means_it_and_a_non_boolean_is_refused() -> None:
    """Servers from before the field computed in float32 or splitllm's kernels: their rows never depended on
    the step."""
    header = {"op": "opened", "session": "s", "max_context": 8, "max_nodes": 4}
    assert messages.decode(wire.encode(header), messages.REPLIES) == OpenedMessage("s", 8, 4)
    with pytest.raises(ProtocolError, match="row_invariant"):
        messages.decode(wire.encode({**header, "row_invariant": 1}), messages.REPLIES)


def test_a_step_is_framed_as_before_the_messages_were_typed() -> None:
    """The header's keys and their order are the protocol's: only the version number moved."""
    step = messages.encode(StepMessage("s", _HIDDEN, "float16", (0, 1), (0,), parents=(-1, 0), id=4))
    (hlen,) = struct.unpack(">I", step[:4])
    assert list(msgpack.unpackb(step[4 : 4 + hlen]).items()) == [
        ("op", "step"), ("id", 4), ("session", "s"), ("keep", [0]), ("positions", [0, 1]), ("parents", [-1, 0]),
        ("dtype", "float16"), ("shape", [2, 3]),
    ]
    open_ = wire.decode(messages.encode(OpenMessage("ab" * 32, (2, 28), "float16", 64, id=1))).header
    assert list(open_) == ["op", "version", "fingerprint", "layers", "dtype", "max_context", "id"]
    assert open_["version"] == messages.PROTOCOL_VERSION == 5
    cropped = messages.encode(StepMessage("s", _HIDDEN, "float16", (0, 1), parents=(-1, 0), id=5, crop=7))
    (hlen,) = struct.unpack(">I", cropped[:4])
    assert msgpack.unpackb(cropped[4 : 4 + hlen])["crop"] == 7  # only a step that crops says so


def _step(**fields: object) -> bytes:
    header = {"op": "step", "session": "s", "positions": [0, 1], "keep": [], **fields}
    return wire.encode(header, _HIDDEN, "float32")


@pytest.mark.parametrize(
    ("message", "code"),
    [
        (wire.encode({"op": "result"}, _HIDDEN), "unknown_op"),  # a reply is no request
        (wire.encode({"op": "attest"}), "unknown_op"),  # the handshake is read before, by the server
        # from before evidence bound the loaded weights
        (wire.encode({"op": "open", "version": 4}), "version_mismatch"),
        (wire.encode({"op": "open", "version": messages.PROTOCOL_VERSION, "layers": [2, 28], "dtype": "float32"}),
         "model_mismatch"),
        (wire.encode({"op": "open", "version": messages.PROTOCOL_VERSION, "fingerprint": "x", "layers": [2],
                      "dtype": "float32"}), "split_mismatch"),
        (wire.encode({"op": "open", "version": messages.PROTOCOL_VERSION, "fingerprint": "x", "layers": [2, 28],
                      "dtype": "int8"}), "bad_dtype"),
        (wire.encode({"op": "open", "version": messages.PROTOCOL_VERSION, "fingerprint": "x", "layers": [2, 28],
                      "dtype": "float32",
                      "max_context": None}), "bad_request"),
        (wire.encode({"op": "step", "positions": [0, 1]}, _HIDDEN), "unknown_session"),
        (wire.encode({"op": "step", "session": "s", "positions": [0, 1]}), "bad_shape"),
        (_step(positions=[0]), "bad_positions"),
        (_step(positions=[0, True]), "bad_positions"),
        (_step(positions=[0, 2**63]), "bad_request"),
        (_step(keep=0), "bad_keep"),
        (_step(keep=[0, 0]), "bad_request"),
        (_step(keep=[-1]), "bad_request"),
        (_step(keep=["0"]), "bad_request"),
        (_step(parents=[-1, 1]), "bad_request"),
        (_step(parents=None), "bad_request"),
        (_step(bits=b"\xd0\x00"), "bad_request"),
        (_step(crop=-1), "bad_request"),
        (_step(crop=1.5), "bad_request"),
        (_step(crop=3, keep=[0]), "bad_keep"),  # a crop drops the previous step: nothing of it to keep
        (wire.encode({"op": "step", "session": "s", "positions": [0, 1]}, _HIDDEN / 0), "bad_values"),
        (wire.encode({"op": "close"}), "unknown_session"),
    ],
)
def test_a_malformed_request_is_refused_on_receipt(message: bytes, code: str) -> None:
    with pytest.raises(ProtocolError) as info:
        messages.decode(message, messages.REQUESTS)
    assert info.value.code == code and info.value.message


def test_a_request_without_visibility_is_a_chain_and_bits_none_too() -> None:
    for message in (_step(), _step(bits=None)):
        step = messages.decode(message, messages.REQUESTS)
        assert isinstance(step, StepMessage) and (step.parents, step.bits) == (None, None)
