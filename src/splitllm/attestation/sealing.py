"""Sealed frames: every protocol message after the handshake, encrypted and authenticated end to end.

Each direction has its own ChaCha20-Poly1305 key and a message counter that is the nonce. A sealed
message is the counter (8 bytes, big-endian) followed by the AEAD ciphertext of one plain frame, so
a proxy that terminates TLS, Ray Serve's proxy or the operator's network stack carries only
ciphertext. A message out of turn (replayed or reordered) or altered by one bit is refused, and the
channel is done: its peer closes the connection, and a client attests afresh to go on.
"""

from __future__ import annotations

import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

_COUNTER = struct.Struct(">Q")
TAG_SIZE = 16
OVERHEAD = _COUNTER.size + TAG_SIZE  # bytes a sealed message adds to its frame


class SealError(RuntimeError):
    """A sealed message that cannot be accepted; `check` says why: replayed, reordered or tampered.

    Never retried in silence: it is an attack on the link, or a fault, and the caller is told.
    """

    def __init__(self, check: str, message: str) -> None:
        super().__init__(f"sealed frame refused ({check}): {message}")
        self.check = check


class SealedChannel:
    """One side's keys: seals what it sends, opens what it receives, each in strict order."""

    def __init__(self, send_key: bytes, receive_key: bytes) -> None:
        self._send, self._receive = ChaCha20Poly1305(send_key), ChaCha20Poly1305(receive_key)
        self._sent = 0
        self._received = 0
        self._broken = False

    @staticmethod
    def _nonce(counter: int) -> bytes:
        return bytes(4) + _COUNTER.pack(counter)

    def seal(self, frame: bytes) -> bytes:
        counter = _COUNTER.pack(self._sent)
        sealed = counter + self._send.encrypt(self._nonce(self._sent), frame, counter)
        self._sent += 1
        return sealed

    def open(self, message: bytes) -> bytes:
        """The plain frame of the next message; SealError (and the channel refuses all after) otherwise."""
        if self._broken:
            raise SealError("closed", "an earlier message was refused; this channel accepts nothing more")
        if len(message) < OVERHEAD:
            self._broken = True
            raise SealError("tampered", f"{len(message)} bytes is shorter than a sealed message")
        (counter,) = _COUNTER.unpack_from(message)
        if counter != self._received:
            self._broken = True
            kind = "replayed" if counter < self._received else "reordered"
            raise SealError(kind, f"message {counter} arrived where {self._received} was due")
        try:
            frame = self._receive.decrypt(self._nonce(counter), message[_COUNTER.size :], message[: _COUNTER.size])
        except InvalidTag:
            self._broken = True
            raise SealError("tampered", "the message failed authentication") from None
        self._received += 1
        return frame
