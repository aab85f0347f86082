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
layers were built from (weights/loaded.py), which a policy's `weights` pins. The same 64 bytes are an
SEV-SNP report's `report_data` and a TDX quote's (whose evidence carries the quote's collateral in
`certs`); when the server's GPUs attest too, either carries `composite_report_data` of them and the
GPUs' evidence digest instead. Keys: X25519 between the two ephemeral keys, then HKDF-SHA256 salted
with the transcript (report_data and the client's key), one key per direction.
"""

from __future__ import annotations

import hashlib
import os
import re
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
from splitllm.attestation.tdx import COLLATERAL, TdxVerified, verify_tdx
from splitllm.attestation.verify import AttestationError, Verified, verify_evidence

NONCE_SIZE = 32
KEY_SIZE = 32
_LABEL = b"splitllm attestation\x00"
_GPU_LABEL = b"splitllm attestation with gpus\x00"


def report_data(
    nonce: bytes, server_key: bytes, fingerprint: str, weights: str, layers: tuple[int, int], version: int
) -> bytes:
    """The 64 bytes a report must carry to answer this handshake."""
    split = struct.pack(">III", layers[0], layers[1], version)
    return hashlib.sha512(
        _LABEL + nonce + server_key + bytes.fromhex(fingerprint) + bytes.fromhex(weights) + split
    ).digest()


def composite_report_data(session: bytes, gpu_digest: bytes) -> bytes:
    """The 64 bytes a report carries when the server's GPUs attest too: this handshake's `report_data` and the
    digest of the GPUs' evidence (`gpu.gpu_evidence_digest`), so the attested guest vouches for that evidence."""
    return hashlib.sha512(_GPU_LABEL + session + gpu_digest).digest()


def _raw(key: X25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _channel(private: X25519PrivateKey, peer: bytes, transcript: bytes, client: bool) -> SealedChannel:
    shared = private.exchange(X25519PublicKey.from_public_bytes(peer))
    up, down = (HKDF(hashes.SHA256(), 32, transcript, label).derive(shared) for label in (b"client to server",
                                                                                          b"server to client"))
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
        """Malformed evidence is the `evidence` check failing, never a crash: every field must have its
        exact type, since a converted one (an int turned into that many zero bytes, a string into
        digits) is a different value than the server sent."""
        certs: Any  # the header's values, whatever was sent: checked below
        layers: Any
        fingerprint: Any
        weights: Any
        certs, layers, fingerprint, weights = h.get("certs"), h.get("layers"), h.get("fingerprint"), h.get("weights")
        valid = {
            "platform": isinstance(h.get("platform"), str),
            "report": isinstance(h.get("report"), bytes),
            "certs": isinstance(certs, dict)
            and all(isinstance(k, str) and isinstance(v, bytes) for k, v in certs.items()),
            "key": isinstance(h.get("key"), bytes) and len(h["key"]) == KEY_SIZE,
            "fingerprint": _is_digest(fingerprint),
            "weights": _is_digest(weights),
            "layers": isinstance(layers, list) and len(layers) == 2 and all(_is_count(n) for n in layers),
            "version": _is_count(h.get("version")),
        }
        malformed = [name for name, ok in valid.items() if not ok]
        if malformed:
            raise AttestationError("evidence", f"the server's evidence is malformed in {', '.join(malformed)}")
        return cls(h["platform"], h["report"], dict(certs), h["key"], fingerprint, weights, (layers[0], layers[1]),
                   h["version"])


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_digest(value: Any) -> bool:
    """64 lowercase hex characters: a SHA-256 fingerprint as the server writes it."""
    return isinstance(value, str) and re.fullmatch("[0-9a-f]{64}", value) is not None


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
        return {"op": "attest", "id": request_id, "version": self.version, "nonce": self.nonce,
                "key": _raw(self._key.public_key())}

    def finish(self, evidence: Evidence, gpu_digest: bytes | None = None) -> tuple[SealedChannel,
                                                                                   Verified | TdxVerified]:
        """Verify `evidence` (AttestationError naming the first failed check) and derive the channel.

        With `gpu_digest` (`gpu.finish_with_gpus`), the report (SEV-SNP) or quote (TDX) must commit to the
        GPUs' evidence as well."""
        if evidence.platform != self.policy.platform:
            raise AttestationError("platform", f"the server offers {evidence.platform} evidence; this client's policy "
                                               f"requires {self.policy.platform}")
        expected = report_data(
            self.nonce, evidence.server_key, evidence.fingerprint, evidence.weights, evidence.layers, evidence.version
        )
        if gpu_digest is not None:
            expected = composite_report_data(expected, gpu_digest)
        verified: Verified | TdxVerified
        if self.policy.tdx is not None:
            verified = verify_tdx(evidence.report, evidence.certs.get(COLLATERAL), self.policy.tdx, expected)
        else:
            verified = self._verify_snp(evidence, expected)
        # The binding holds: the attested server claims this model and split and loaded these weights. Expected?
        if evidence.version != self.version:
            raise AttestationError("version",
                                   f"the server speaks protocol {evidence.version}, this client {self.version}")
        if evidence.fingerprint != self.fingerprint:
            raise AttestationError("model",
                                   f"the attested server runs another model (fingerprint {evidence.fingerprint[:16]}, "
                                            f"this client's {self.fingerprint[:16]})")
        if evidence.layers != self.layers:
            raise AttestationError("split",
                                   f"the attested server runs layers [{evidence.layers[0]}, {evidence.layers[1]}), "
                                            f"this client needs [{self.layers[0]}, {self.layers[1]})")
        if self.policy.weights is not None and bytes.fromhex(evidence.weights) not in self.policy.weights:
            raise AttestationError("weights", f"the attested server built its layers from weights (loaded-weights "
                                              f"fingerprint {evidence.weights[:16]}) that the policy does not name: "
                                              "another model, split or precision, or altered files")
        transcript = hashlib.sha256(expected + _raw(self._key.public_key())).digest()
        return _channel(self._key, evidence.server_key, transcript, client=True), verified

    def _verify_snp(self, evidence: Evidence, expected: bytes) -> Verified:
        if "vcek" not in evidence.certs:
            raise AttestationError("evidence", "the evidence carries no VCEK certificate")
        try:
            report = SnpReport.parse(evidence.report)
            vcek = load_certificate(evidence.certs["vcek"])
        except ValueError as exc:
            raise AttestationError("evidence", str(exc)) from None
        return verify_evidence(report, vcek, self.policy, expected)


def answer(
    request: dict[str, Any], attester: Any, fingerprint: str, weights: str, layers: tuple[int, int], version: int
) -> tuple[Evidence, SealedChannel]:
    """The server's side of `attest`: a new key, a report bound to it, and the channel it opens.

    `attester` has `platform` and `report(report_data) -> (report bytes, certificates by role)`.
    """
    nonce, client_key = request.get("nonce"), request.get("key")
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_SIZE or not isinstance(client_key,
                                                                                  bytes) or len(client_key) != KEY_SIZE:
        raise ValueError(f"attest needs a {NONCE_SIZE}-byte nonce and a {KEY_SIZE}-byte X25519 key")
    key = X25519PrivateKey.generate()
    server_key = _raw(key.public_key())
    data = report_data(nonce, server_key, fingerprint, weights, layers, version)
    report, certs = attester.report(data)
    transcript = hashlib.sha256(data + client_key).digest()
    evidence = Evidence(attester.platform, report, certs, server_key, fingerprint, weights, layers, version)
    return evidence, _channel(key, client_key, transcript, client=False)
