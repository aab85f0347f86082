"""Where one decoding step's time went, as the client measures it (the server reports its compute)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class StepStats:
    """One step's wall time `total_ms` = head + serialize + round trip + deserialize + tail + decode (+ other).

    The round trip splits into the server's compute (`server_ms`, reported in its reply) and the
    network (link plus framing on both ends). `decode_ms` is the decoder's own time: everything in
    the step outside the pipeline's scoring (proposing, building the tree, verifying, the generator hop).
    """

    nodes: int = 0
    accepted: int = 0
    drafted: int = 0  # candidate-tree nodes among `nodes` (speculative decoding)
    window: int = 0  # lookahead-window nodes among `nodes`
    proposer: str = ""  # whose draft the accepted path came from ("" if no draft token was accepted)
    sources: dict[str, int] = field(default_factory=dict)  # accepted draft tokens by their node's sources ("a+b": both)
    draft_ms: float = 0.0  # the drafter's share of decode_ms (syncing its cache, growing the tree)
    overlap_ms: float = 0.0  # client work while the round trip was in flight (reading a prefill, preparing a tree)
    prepared: int = 0  # 1: the next step's tree was prepared while this step was in flight
    adopted: int = 0  # 1: this step's tree was the one prepared while the last step was in flight
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

    @property
    def other_ms(self) -> float:
        """Wall time no part accounts for: the client's per-step bookkeeping (stop rules, detokenizing)."""
        return self.total_ms - self.client_ms - self.round_trip_ms

    def as_dict(self) -> dict[str, float | str]:
        d = asdict(self)
        d.update(network_ms=self.network_ms, client_ms=self.client_ms, other_ms=self.other_ms)
        return d


def mean_stats(steps: list[StepStats]) -> dict[str, float]:
    """Per-field means over steps (empty dict for no steps)."""
    if not steps:
        return {}
    keys = [f.name for f in fields(StepStats) if f.type in ("int", "float")] + ["network_ms", "client_ms", "other_ms"]
    rows = [s.as_dict() for s in steps]
    return {k: sum(r[k] for r in rows) / len(rows) for k in keys}  # type: ignore[misc]
