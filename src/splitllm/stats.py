"""Where one decoding step's time went, as the client measures it (the server reports its compute)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass
class StepStats:
    nodes: int = 0
    accepted: int = 0
    head_ms: float = 0.0
    serialize_ms: float = 0.0
    round_trip_ms: float = 0.0
    server_ms: float = 0.0
    deserialize_ms: float = 0.0
    tail_ms: float = 0.0
    decode_ms: float = 0.0
    total_ms: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    context: int = 0

    @property
    def network_ms(self) -> float:
        """Round trip minus the server's own compute: the link plus framing on both ends."""
        return max(self.round_trip_ms - self.server_ms, 0.0)

    @property
    def client_ms(self) -> float:
        return self.head_ms + self.serialize_ms + self.deserialize_ms + self.tail_ms + self.decode_ms

    def as_dict(self) -> dict[str, float]:
        d = asdict(self)
        d.update(network_ms=self.network_ms, client_ms=self.client_ms)
        return d


def mean_stats(steps: list[StepStats]) -> dict[str, float]:
    """Per-field means over steps (empty dict for no steps)."""
    if not steps:
        return {}
    keys = [f.name for f in fields(StepStats)] + ["network_ms", "client_ms"]
    rows = [s.as_dict() for s in steps]
    return {k: sum(r[k] for r in rows) / len(rows) for k in keys}
