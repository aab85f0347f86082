"""How a server is configured: one frozen record of its split, precision, limits and timeouts."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch

from splitllm.model.precision import Precision, asked
from splitllm.options import SERVE, Split, option, options_of
from splitllm.server.setting_fields import fields_of

_SERVE = MappingProxyType(fields_of(**{o.name: o.default for o in options_of(SERVE) if o.group == "server"}))


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    """Everything a server is configured with, by name; the defaults are `splitllm serve`'s (splitllm.options)."""

    first: int = Split.first
    last: int = Split.last
    # The middle layers' compute dtype and weight-only quantization (none, int8, int4 or mixed): neither given
    # is the fastest here, as for `serve`; one given alone takes the exact mode's other (float32, none).
    dtype: torch.dtype | None = None
    quant: str | None = None
    device: str = option(SERVE, "device").default
    max_context: int = _SERVE["max_context"]
    max_sessions: int = _SERVE["max_sessions"]
    session_ttl_s: float = _SERVE["session_ttl_s"]
    max_nodes_per_step: int = _SERVE["max_nodes_per_step"]  # announced to clients, which split longer prefills
    max_frame_bytes: int = _SERVE["max_frame_bytes"]
    # None: with a token table, a quarter of max_sessions; without one, all of them.
    max_sessions_per_principal: int | None = _SERVE["max_sessions_per_principal"]
    max_kv_bytes: int = _SERVE["max_kv_bytes"]  # KV caches are preallocated: this bounds the memory sessions can take
    idle_timeout_s: float = _SERVE["idle_timeout_s"]  # a connection silent this long is closed
    send_timeout_s: float = _SERVE["send_timeout_s"]  # a reply the peer does not take within this ends its connection
    max_connections: int = _SERVE["max_connections"]  # further WebSockets are closed with 1013, try again later
    batch_window_ms: float = _SERVE["batch_window_ms"]  # steps of different sessions this close share a forward; 0: off
    # None: with a token table, a quarter of max_connections / max_sessions; without one, all of them.
    max_connections_per_principal: int | None = _SERVE["max_connections_per_principal"]
    operators: tuple[str, ...] = ()  # principals whose /health and /metrics show the whole server
    max_batch_rows: int = _SERVE["max_batch_rows"]  # positions in one shared forward; more wait for later forwards
    slice_rows: int = _SERVE["slice_rows"]  # a step longer than slice_above runs as forwards of this many positions
    slice_above: int = _SERVE["slice_above"]  # a step this long or shorter (a speculative tree) runs in one forward
    max_batch_bytes: int = _SERVE["max_batch_bytes"]  # estimated activation and mask bytes of one shared forward
    handshake_timeout_s: float = _SERVE["handshake_timeout_s"]  # a request head not complete this long is dropped
    max_header_bytes: int = _SERVE["max_header_bytes"]  # request line plus headers
    max_header_lines: int = 64
    attestation: str = _SERVE["attestation"]  # none, sev-snp, tdx or simulated (docs/confidential.md)
    attestation_sim: str | None = _SERVE["attestation_sim"]  # `splitllm attest sim-init`'s folder, for "simulated"
    attestation_collateral: str = _SERVE["attestation_collateral"]  # Intel's PCS or a PCCS, for "tdx"

    def __post_init__(self) -> None:
        for name in ("max_nodes_per_step", "max_batch_rows", "slice_rows", "slice_above"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    @property
    def precision(self) -> Precision:
        return asked(self.dtype, self.quant, self.device)
