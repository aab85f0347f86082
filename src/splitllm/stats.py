"""What one decoding step cost and what it speculated, as the client records them.

A step's record has two parts, written by different code: `StepTiming`, filled in as the step runs
(the pipeline, the middle, the decoder and the client each add their part), and `StepSpeculation`,
built once by the decoder from its tree and the model's verdict. `SpeculationMetrics` sums the
speculation of many steps. Published results keep one flat dict per step (`StepStats.as_dict`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields

# The flat record's keys in the order published results and API responses have them.
_FLAT_ORDER = (
    "nodes", "accepted", "drafted", "window", "proposer", "sources", "draft_ms", "overlap_ms", "prepared", "adopted",
    "sent_ahead", "ran_ahead",
    "first_ms", "serialize_ms", "round_trip_ms", "server_ms", "deserialize_ms", "last_ms", "decode_ms", "total_ms",
    "bytes_up", "bytes_down", "context",
)


@dataclass
class StepTiming:
    """One step's wall time `total_ms` = first + serialize + round trip + deserialize + last + decode (+ other).

    The round trip splits into the server's compute (`server_ms`, reported in its reply) and the
    network (link plus framing on both ends). `decode_ms` is the decoder's own time: everything in
    the step outside the pipeline's scoring (proposing, building the tree, verifying, the generator hop).
    """

    nodes: int = 0  # positions the step sent: the fed chain, the tree and the window
    context: int = 0  # positions committed in the caches when the step ran
    first_ms: float = 0.0
    serialize_ms: float = 0.0
    round_trip_ms: float = 0.0
    server_ms: float = 0.0
    deserialize_ms: float = 0.0
    last_ms: float = 0.0
    decode_ms: float = 0.0
    draft_ms: float = 0.0  # the drafter's share of decode_ms (syncing its cache, growing the tree)
    overlap_ms: float = 0.0  # client work while the round trip was in flight (reading a prefill, preparing a tree)
    total_ms: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0

    @property
    def network_ms(self) -> float:
        """Round trip minus the server's own compute: the link plus framing on both ends."""
        return max(self.round_trip_ms - self.server_ms, 0.0)

    @property
    def client_ms(self) -> float:
        return self.first_ms + self.serialize_ms + self.deserialize_ms + self.last_ms + self.decode_ms

    @property
    def other_ms(self) -> float:
        """Wall time no part accounts for: the client's per-step bookkeeping (stop rules, detokenizing)."""
        return self.total_ms - self.client_ms - self.round_trip_ms


@dataclass(frozen=True)
class StepSpeculation:
    """What a step speculated and what of it the model confirmed, built once by the decoder (sequential
    decoding: the tokens emitted, nothing drafted). A stop string that clips the step's tokens gives a
    copy with fewer `accepted` (`dataclasses.replace`); the rest stays what the model confirmed."""

    accepted: int = 0  # tokens the step emitted: its accepted draft tokens plus the model's own next token
    drafted: int = 0  # candidate-tree nodes among the step's nodes
    window: int = 0  # lookahead-window nodes among the step's nodes
    proposer: str = ""  # whose draft the accepted path came from ("" if no draft token was accepted)
    sources: dict[str, int] = field(default_factory=dict)  # accepted draft tokens by their node's sources ("a+b": both)
    prepared: int = 0  # 1: the next step's tree was prepared while this step was in flight
    adopted: int = 0  # 1: this step's tree was the one prepared while the last step was in flight
    sent_ahead: int = 0  # 1: the next step went to the server before this one's reply came back
    ran_ahead: int = 0  # 1: this step was sent ahead on the last one's likely outcome, and the outcome came true


@dataclass(frozen=True)
class StepStats:
    """One step's record: how long its parts took and what it speculated."""

    timing: StepTiming
    speculation: StepSpeculation

    def flat(self) -> dict[str, object]:
        """Both parts' fields in one dict, in the published order (`from_flat` reads it back)."""
        parts = {**asdict(self.timing), **asdict(self.speculation)}
        ordered = {k: parts.pop(k) for k in _FLAT_ORDER}
        return {**ordered, **parts}

    def as_dict(self) -> dict[str, object]:
        """The flat record plus the derived timings (network, client, other), as results publish a step."""
        t = self.timing
        return {**self.flat(), "network_ms": t.network_ms, "client_ms": t.client_ms, "other_ms": t.other_ms}

    @classmethod
    def from_flat(cls, d: Mapping[str, object]) -> StepStats:
        """A record from a flat dict (`flat`, `as_dict`, saved results): keys of neither part (the derived
        timings) are ignored, missing ones take their defaults."""

        def part(kind: type) -> dict[str, object]:
            names = {f.name for f in fields(kind)}
            return {k: v for k, v in d.items() if k in names}

        return cls(StepTiming(**part(StepTiming)), StepSpeculation(**part(StepSpeculation)))  # type: ignore[arg-type]


def mean_stats(steps: list[StepStats]) -> dict[str, float]:
    """Means over steps of every numeric key of `StepStats.as_dict` (empty dict for no steps)."""
    if not steps:
        return {}
    rows = [s.as_dict() for s in steps]
    keys = [k for k, v in rows[0].items() if isinstance(v, (int, float))]
    return {k: sum(r[k] for r in rows) / len(rows) for k in keys}  # type: ignore[misc]


@dataclass(frozen=True)
class SpeculationMetrics:
    """What speculation yielded over some steps, summed as vLLM's SpecDecodeWorkerMetrics sums it.

    `tokens`: emitted (every step's `accepted`); `drafted`: candidate-tree nodes sent; `accepted_drafts`:
    tree nodes the model confirmed, `sources` the same by their nodes' sources. Each step emits its
    accepted draft tokens and one of the model's own, so `tokens` = `accepted_drafts` + `steps`, less what
    a stop string clipped off a generation's last step (the clip drops emitted tokens only).
    """

    steps: int
    tokens: int
    drafted: int
    accepted_drafts: int
    sources: dict[str, int]

    @classmethod
    def of(cls, steps: Iterable[StepStats]) -> SpeculationMetrics:
        specs = [s.speculation for s in steps]
        sources: Counter[str] = Counter()
        for s in specs:
            sources.update(s.sources)
        return cls(len(specs), sum(s.accepted for s in specs), sum(s.drafted for s in specs),
                   sum(sources.values()), dict(sources))

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens per drafted node."""
        return self.accepted_drafts / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def efficiency(self) -> float:
        """Emitted tokens per position the model verified (each step's root, whose next token it always
        emits, plus the tree's nodes): the share of the verification that became output, 1 for sequential
        decoding, lower the more nodes a tree sends that the model rejects."""
        return self.tokens / (self.steps + self.drafted) if self.steps else 0.0
