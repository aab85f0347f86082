"""A fitted latency model of one decoding step, to predict tokens per second on any link.

A step's wall time is split into parts that depend on different things:

    local    = first + last stages on the client        a + b*nodes + c*single + d*context
                                                        + e*nodes*context + f*accepted + g*windowed
    server   = middle compute, as the server reports it a + b*nodes + c*single + d*context + e*nodes*context
    overhead = client (de)serialization, bookkeeping    a + b*bytes + c*context
    decode   = the decoder's own time (per decoder)     a + b*nodes + c*accepted
    network  = link RTT + bytes / bandwidth + framing   framing = a + b*bytes
    bytes    = bytes up, bytes down                     a + b*nodes + c*accepted (each way)

`single` marks one-position steps: their projections run as matrix-vector products, a different
(cheaper per row) kernel than the matrix-matrix products of several positions. The client's LM
head runs only on the rows the verifier walks (one per emitted token), plus one approximate pass
over the lookahead window's outputs when a step has a window, hence `accepted` and `windowed` in
its cost. Every part is linear in its features, so the mean step time of a
workload is the model applied to the workload's mean features (`StepShape`): predictions need no
per-step simulation. Tokens per step come from measurement (how many tokens a decoder accepts at a
budget), time from the model.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from splitllm.stats import StepStats

COMPUTE = ("1", "nodes", "single", "context", "nodes*context")
LOCAL = (*COMPUTE, "accepted", "windowed")
PER_BYTE = ("1", "bytes")
OVERHEAD = (*PER_BYTE, "context")
STEP_SIZE = ("1", "nodes", "accepted")
_PARTS = ("local", "server", "overhead", "framing", "wire_up", "wire_down")


@dataclass(frozen=True)
class Link:
    """A network path as the model sees it: round-trip time and an optional bandwidth cap each way."""

    rtt_ms: float
    bandwidth_mbit: float | None = None

    def transfer_ms(self, nbytes: float) -> float:
        """Time to push nbytes through the bottleneck (0 without a cap)."""
        return 0.0 if self.bandwidth_mbit is None else nbytes * 8 / (self.bandwidth_mbit * 1e3)


@dataclass(frozen=True)
class StepShape:
    """Mean features of a workload's decode steps; linear parts of the model only need these means."""

    nodes: float
    context: float
    nodes_context: float
    accepted: float
    windowed: float = 0.0  # share of steps carrying a lookahead window
    single: float = 0.0  # share of one-position steps
    bytes_up: float = 0.0
    bytes_down: float = 0.0

    @classmethod
    def of(cls, steps: Sequence[StepStats]) -> StepShape:
        if not steps:
            raise ValueError("a step shape needs at least one step")
        n = len(steps)
        times, specs = [s.timing for s in steps], [s.speculation for s in steps]
        return cls(
            nodes=sum(t.nodes for t in times) / n,
            context=sum(t.context for t in times) / n,
            nodes_context=sum(t.nodes * t.context for t in times) / n,
            accepted=sum(s.accepted for s in specs) / n,
            windowed=sum(s.window > 0 for s in specs) / n,
            single=sum(t.nodes == 1 for t in times) / n,
            bytes_up=sum(t.bytes_up for t in times) / n,
            bytes_down=sum(t.bytes_down for t in times) / n,
        )

    @classmethod
    def at(
        cls, nodes: float, context: float, accepted: float, windowed: float = 0.0, single: float | None = None
    ) -> StepShape:
        """A hypothetical step (bytes left to the model); `single` defaults to whether nodes is 1."""
        return cls(nodes, context, nodes * context, accepted, windowed, float(nodes == 1) if single is None else single)

    def features(self) -> dict[str, float]:
        return {
            "1": 1.0,
            "nodes": self.nodes,
            "context": self.context,
            "nodes*context": self.nodes_context,
            "accepted": self.accepted,
            "windowed": self.windowed,
            "single": self.single,
        }


def step_features(s: StepStats) -> dict[str, float]:
    """A measured step's features, its bytes on the wire included."""
    x = StepShape.of([s]).features()
    x["bytes"] = float(s.timing.bytes_up + s.timing.bytes_down)
    return x


@dataclass(frozen=True)
class LinearFit:
    """y = sum(coef[i] * x[features[i]])."""

    features: tuple[str, ...]
    coef: tuple[float, ...]

    def __call__(self, x: Mapping[str, float]) -> float:
        return sum(c * x[f] for f, c in zip(self.features, self.coef))

    def as_dict(self) -> dict[str, float]:
        return dict(zip(self.features, self.coef))

    @classmethod
    def fit(cls, features: Sequence[str], xs: Sequence[Mapping[str, float]], ys: Sequence[float]) -> LinearFit:
        """Least squares; features the data cannot tell apart get the minimum-norm split."""
        if not xs:
            raise ValueError("cannot fit a model to no data")
        a = np.array([[x[f] for f in features] for x in xs], dtype=np.float64)
        scale = np.abs(a).max(axis=0)
        scale[scale == 0] = 1.0
        coef, *_ = np.linalg.lstsq(a / scale, np.asarray(ys, dtype=np.float64), rcond=None)
        return cls(tuple(features), tuple(float(c) for c in coef / scale))


@dataclass(frozen=True)
class StepRecord:
    """One measured decode step and the link and decoder it ran with."""

    stats: StepStats
    link: Link
    decoder: str


@dataclass(frozen=True)
class Breakdown:
    """Predicted mean step time by part, in ms, and the tokens per second it implies."""

    local: float
    server: float
    overhead: float
    decode: float
    rtt: float
    transfer: float
    framing: float
    accepted: float

    @property
    def total(self) -> float:
        return self.local + self.server + self.overhead + self.decode + self.rtt + self.transfer + self.framing

    @property
    def tokens_per_second(self) -> float:
        return self.accepted / self.total * 1000 if self.total > 0 else 0.0


@dataclass
class LatencyProfile:
    """Fitted coefficients of one (model, split, client machine, server machine); saved as JSON."""

    local: LinearFit
    server: LinearFit
    overhead: LinearFit
    framing: LinearFit
    wire_up: LinearFit
    wire_down: LinearFit
    decode: dict[str, LinearFit] = field(default_factory=dict)

    @classmethod
    def fit(cls, records: Iterable[StepRecord]) -> LatencyProfile:
        """Fit every part from measured decode steps (prefill steps do not belong here)."""
        records = list(records)
        xs = [step_features(r.stats) for r in records]
        times = [r.stats.timing for r in records]
        by_decoder: dict[str, list[int]] = {}
        for i, r in enumerate(records):
            by_decoder.setdefault(r.decoder, []).append(i)
        framing = [
            t.network_ms - r.link.rtt_ms - r.link.transfer_ms(t.bytes_up + t.bytes_down) for r, t in zip(records, times)
        ]
        return cls(
            local=LinearFit.fit(LOCAL, xs, [t.first_ms + t.last_ms for t in times]),
            server=LinearFit.fit(COMPUTE, xs, [t.server_ms for t in times]),
            overhead=LinearFit.fit(OVERHEAD, xs, [t.serialize_ms + t.deserialize_ms + t.other_ms for t in times]),
            framing=LinearFit.fit(PER_BYTE, xs, framing),
            wire_up=LinearFit.fit(STEP_SIZE, xs, [t.bytes_up for t in times]),
            wire_down=LinearFit.fit(STEP_SIZE, xs, [t.bytes_down for t in times]),
            decode={
                name: LinearFit.fit(STEP_SIZE, [xs[i] for i in idx], [times[i].decode_ms for i in idx])
                for name, idx in by_decoder.items()
            },
        )

    def bytes(self, shape: StepShape) -> tuple[float, float]:
        """Bytes up and down of a step: measured when the shape has them, else modeled from its nodes."""
        if shape.bytes_up and shape.bytes_down:
            return shape.bytes_up, shape.bytes_down
        x = shape.features()
        return self.wire_up(x), self.wire_down(x)

    def predict(self, shape: StepShape, link: Link, decoder: str) -> Breakdown:
        """Mean step time of a workload of this shape, with this decoder, over this link."""
        if decoder not in self.decode:
            raise KeyError(f"no decode-time fit for decoder {decoder!r}; fitted: {', '.join(self.decode)}")
        x = shape.features()
        up, down = self.bytes(shape)
        x["bytes"] = up + down
        return Breakdown(
            local=self.local(x),
            server=self.server(x),
            overhead=self.overhead(x),
            decode=self.decode[decoder](x),
            rtt=link.rtt_ms,
            transfer=link.transfer_ms(up + down),
            framing=self.framing(x),
            accepted=shape.accepted,
        )

    def to_json(self) -> dict:
        parts: dict = {k: getattr(self, k).as_dict() for k in _PARTS}
        parts["decode"] = {name: fit.as_dict() for name, fit in self.decode.items()}
        return parts

    @classmethod
    def from_json(cls, data: Mapping) -> LatencyProfile:
        def lin(d: Mapping[str, float]) -> LinearFit:
            return LinearFit(tuple(d), tuple(float(v) for v in d.values()))

        return cls(
            **{k: lin(data[k]) for k in _PARTS},
            decode={name: lin(d) for name, d in data.get("decode", {}).items()},
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> LatencyProfile:
        return cls.from_json(json.loads(Path(path).read_text()))


def ideal_tokens_per_second(steps: Sequence[StepStats], link: Link) -> float:
    """The physical limit of measured steps: tokens over RTT + wire transfer + all compute, nothing else."""
    ms = sum(
        link.rtt_ms + link.transfer_ms(t.bytes_up + t.bytes_down) + t.first_ms + t.last_ms + t.server_ms + t.decode_ms
        for t in (s.timing for s in steps)
    )
    return sum(s.speculation.accepted for s in steps) / ms * 1000 if ms > 0 else 0.0


def tokens_per_second(steps: Sequence[StepStats]) -> float:
    """Measured decode speed of steps: tokens over their wall time."""
    ms = sum(s.timing.total_ms for s in steps)
    return sum(s.speculation.accepted for s in steps) / ms * 1000 if ms > 0 else 0.0
