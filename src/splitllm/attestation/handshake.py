"""The attestation handshake: a fresh nonce and key from the client, evidence bound to both from the
server, and the sealed channel both derive from it.

    client -> server   attest    {version, nonce (32 bytes), key: the client's X25519 public key}
    server -> client   evidence  {platform, report, certs, key: the server's X25519 public key,
                                  fingerprint, weights, layers, version}

The report's `report_data` is SHA-512 over a label, the nonce, the server's key, the model
fingerprint, the loaded-weights fingerprint, the split and the protocol version (`report_data`), so
a report answers exactly this handshake, from a server that holds that key inside the attested guest
and computes its split with the weights it loaded. The model fingerprint is the server's account of
which model it runs (as in `open`); the loaded-weights fingerprint is the digest of the bytes its
layers were built from (weights/loaded.py), which a policy's `weights` pins. Keys: X25519 between
the two ephemeral keys, then HKDF-SHA256 salted with the transcript (report_data and the client's
key), one key per direction.
"""

from __future__ import annotations

import hashlib
import os
import struct
import warnings
from dataclasses import dataclass, field
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.utils import CryptographyDeprecationWarning

from splitllm.attestation.policy import AttestationPolicy
from splitllm.attestation.sealing import SealedChannel
from splitllm.attestation.snp import SnpReport
from splitllm.attestation.verify import AttestationError, Verified, verify_evidence

NONCE_SIZE = 32
KEY_SIZE = 32
_LABEL = b"splitllm attestation\x00"


def report_data(
    nonce: bytes, server_key: bytes, fingerprint: str, weights: str, layers: tuple[int, int], version: int
) -> bytes:
    """The 64 bytes a report must carry to answer this handshake."""
    split = struct.pack(">III", layers[0], layers[1], version)
    return hashlib.sha512(_LABEL + nonce + server_key + bytes.fromhex(fingerprint) + bytes.fromhex(weights) + split).digest()


def _raw(key: X25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _channel(private: X25519PrivateKey, peer: bytes, transcript: bytes, client: bool) -> SealedChannel:
    shared = private.exchange(X25519PublicKey.from_public_bytes(peer))
    up, down = (HKDF(hashes.SHA256(), 32, transcript, label).derive(shared) for label in (b"client to server", b"server to client"))
    return SealedChannel(up, down) if client else SealedChannel(down, up)


def load_certificate(der: bytes) -> x509.Certificate:
    """A DER certificate; AMD's VCEKs carry serial number 0, which cryptography warns about."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CryptographyDeprecationWarning)
        return x509.load_der_x509_certificate(der)


@dataclass(frozen=True)
class Evidence:
    """The server's answer to `attest`, as it travels in the `evidence` message."""

    platform: str
    report: bytes
    certs: dict[str, bytes]
    server_key: bytes
    fingerprint: str
    weights: str  # the loaded-weights fingerprint (weights/loaded.py)
    layers: tuple[int, int]
    version: int

    def header(self, request_id: Any) -> dict[str, Any]:
        return {
            "op": "evidence", "id": request_id, "platform": self.platform, "report": self.report,
            "certs": self.certs, "key": self.server_key, "fingerprint": self.fingerprint,
            "weights": self.weights, "layers": list(self.layers), "version": self.version,
        }

    @classmethod
    def from_header(cls, h: dict[str, Any]) -> Evidence:
        """Malformed evidence is the `evidence` check failing, never a crash."""
        try:
            certs = h["certs"]
            layers = h["layers"]
            ev = cls(
                str(h["platform"]), bytes(h["report"]), {str(k): bytes(v) for k, v in certs.items()},
                bytes(h["key"]), str(h["fingerprint"]), str(h["weights"]), (int(layers[0]), int(layers[1])),
                int(h["version"]),
            )
            if len(bytes.fromhex(ev.fingerprint)) != 32 or len(bytes.fromhex(ev.weights)) != 32:
                raise ValueError("a fingerprint is not 64 hex characters")
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise AttestationError("evidence", f"the server's evidence is malformed ({type(exc).__name__}: {exc})") from None
        if len(ev.server_key) != KEY_SIZE:
            raise AttestationError("evidence", "the server's key is not an X25519 public key")
        return ev


@dataclass
class ClientHandshake:
    """The client's side: `request()` to send, then `finish(evidence)` verifies and yields the channel."""

    policy: AttestationPolicy
    fingerprint: str
    layers: tuple[int, int]
    version: int
    nonce: bytes = field(default_factory=lambda: os.urandom(NONCE_SIZE))
    _key: X25519PrivateKey = field(default_factory=X25519PrivateKey.generate, repr=False)

    def request(self, request_id: Any) -> dict[str, Any]:
        return {"op": "attest", "id": request_id, "version": self.version, "nonce": self.nonce, "key": _raw(self._key.public_key())}

    def finish(self, evidence: Evidence) -> tuple[SealedChannel, Verified]:
        """Verify `evidence` (AttestationError naming the first failed check) and derive the channel."""
        if evidence.platform != "sev-snp":
            raise AttestationError("platform", f"the server offers {evidence.platform} evidence; this client verifies sev-snp")
        if "vcek" not in evidence.certs:
            raise AttestationError("evidence", "the evidence carries no VCEK certificate")
        try:
            report = SnpReport.parse(evidence.report)
            vcek = load_certificate(evidence.certs["vcek"])
            ask = load_certificate(evidence.certs["ask"]) if "ask" in evidence.certs else None
        except ValueError as exc:
            raise AttestationError("evidence", str(exc)) from None
        expected = report_data(
            self.nonce, evidence.server_key, evidence.fingerprint, evidence.weights, evidence.layers, evidence.version
        )
        verified = verify_evidence(report, vcek, ask, self.policy, expected)
        # The binding holds: the attested server claims this model and split and loaded these weights. Expected?
        if evidence.version != self.version:
            raise AttestationError("version", f"the server speaks protocol {evidence.version}, this client {self.version}")
        if evidence.fingerprint != self.fingerprint:
            raise AttestationError("model", f"the attested server runs another model (fingerprint {evidence.fingerprint[:16]}, "
                                            f"this client's {self.fingerprint[:16]})")
        if evidence.layers != self.layers:
            raise AttestationError("split", f"the attested server runs layers [{evidence.layers[0]}, {evidence.layers[1]}), "
                                            f"this client needs [{self.layers[0]}, {self.layers[1]})")
        if self.policy.weights is not None and bytes.fromhex(evidence.weights) not in self.policy.weights:
            raise AttestationError("weights", f"the attested server built its layers from weights (loaded-weights "
                                              f"fingerprint {evidence.weights[:16]}) that the policy does not name: "
                                              "another model, split or precision, or altered files")
        transcript = hashlib.sha256(report.report_data + _raw(self._key.public_key())).digest()
        return _channel(self._key, evidence.server_key, transcript, client=True), verified


def answer(
    request: dict[str, Any], attester: Any, fingerprint: str, weights: str, layers: tuple[int, int], version: int
) -> tuple[Evidence, SealedChannel]:
    """The server's side of `attest`: a new key, a report bound to it, and the channel it opens.

    `attester` has `platform` and `report(report_data) -> (report bytes, certificates by role)`.
    """
    nonce, client_key = request.get("nonce"), request.get("key")
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_SIZE or not isinstance(client_key, bytes) or len(client_key) != KEY_SIZE:
        raise ValueError(f"attest needs a {NONCE_SIZE}-byte nonce and a {KEY_SIZE}-byte X25519 key")
    key = X25519PrivateKey.generate()
    server_key = _raw(key.public_key())
    data = report_data(nonce, server_key, fingerprint, weights, layers, version)
    report, certs = attester.report(data)
    transcript = hashlib.sha256(data + client_key).digest()
    evidence = Evidence(attester.platform, report, certs, server_key, fingerprint, weights, layers, version)
    return evidence, _channel(key, client_key, transcript, client=False)
