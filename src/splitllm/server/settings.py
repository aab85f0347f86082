"""How a server is configured: one frozen record of its split, precision, limits and timeouts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitllm.model.precision import Precision


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    """Everything a server is configured with, by name (`splitllm serve` maps its options here)."""

    head: int = 2
    tail: int = 2
    dtype: torch.dtype = torch.float32
    quant: str = "none"  # weight-only quantization of the middle layers: none, int8 or int4
    device: str = "cpu"
    max_context: int = 4096
    max_sessions: int = 64
    session_ttl_s: float = 600.0
    max_nodes_per_step: int = 256  # announced to clients, which split longer prefills into steps this size
    max_frame_bytes: int = 64 << 20
    max_sessions_per_principal: int | None = None  # None: a quarter of max_sessions with tokens, else all
    max_kv_bytes: int = 8 << 30  # KV caches are preallocated: this bounds the memory sessions can take
    idle_timeout_s: float = 600.0  # a connection silent this long is closed
    send_timeout_s: float = 30.0  # a reply the peer does not take within this ends its connection
    max_connections: int = 256  # further WebSockets are closed with 1013, try again later (/health never is)
    batch_window_ms: float = 2.0  # steps of different sessions this close together share a forward; 0: off
    # None: with a token table, a quarter of max_connections / max_sessions; without one, all of them.
    max_connections_per_principal: int | None = None
    operators: tuple[str, ...] = ()  # principals whose /health and /metrics show the whole server
    max_batch_rows: int = 256  # positions in one shared forward; more waiting steps run in later forwards
    slice_rows: int = 16  # a step longer than slice_above runs as forwards of this many positions, others' steps in between
    slice_above: int = 64  # a step this long or shorter (a speculative tree) always runs in one forward
    max_batch_bytes: int = 256 << 20  # estimated activation and mask bytes of one shared forward
    handshake_timeout_s: float = 10.0  # a request head not complete this long after connecting is dropped
    max_header_bytes: int = 16 << 10  # request line plus headers
    max_header_lines: int = 64
    attestation: str = "none"  # evidence the server offers: none, sev-snp, tdx or simulated (docs/confidential.md)
    attestation_sim: str | None = None  # the folder of `splitllm attest sim-init`, with attestation="simulated"

    def __post_init__(self) -> None:
        for name in ("max_nodes_per_step", "max_batch_rows", "slice_rows", "slice_above"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    @property
    def precision(self) -> Precision:
        return Precision(self.dtype, self.quant, self.device)
