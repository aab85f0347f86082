"""Prometheus metrics of one server, on a registry of its own (several servers may share a process).

Counters of work done carry a `principal` label, so each principal can be shown its own figures
and nothing about the others (`render(principal)`); an operator gets the whole registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

# Step compute time, 1 ms to ~30 s: one-token steps of small models up to long prefills.
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class ServerMetrics:
    def __init__(self, sessions: Callable[[], float], kv_bytes: Callable[[], float], kv_limit: int) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        Gauge("splitllm_sessions", "Open sessions", registry=r).set_function(sessions)
        Gauge("splitllm_kv_bytes", "Bytes of KV cache reserved by open sessions", registry=r).set_function(kv_bytes)
        Gauge("splitllm_kv_bytes_limit", "Configured bound on KV cache bytes", registry=r).set(kv_limit)
        self.connections = Gauge("splitllm_connections", "Open WebSocket connections", registry=r)
        self.sessions_opened = Counter("splitllm_sessions_opened", "Sessions opened", ["principal"], registry=r)
        self.steps = Counter("splitllm_steps", "Steps computed", ["principal"], registry=r)
        self.step_nodes = Counter("splitllm_step_nodes", "Positions computed in steps", ["principal"], registry=r)
        self.step_seconds = Histogram(
            "splitllm_step_seconds", "Compute time of a step", buckets=_STEP_BUCKETS, registry=r
        )
        self.batch_size = Histogram(
            "splitllm_batch_sessions", "Sessions whose steps shared one forward pass", buckets=_BATCH_BUCKETS,
            registry=r
        )
        self.bytes_in = Counter("splitllm_received_bytes", "Bytes of WebSocket messages received", ["principal"],
                                registry=r)
        self.bytes_out = Counter("splitllm_sent_bytes", "Bytes of WebSocket messages sent", ["principal"], registry=r)
        self.errors = Counter("splitllm_errors", "Refused requests by error code", ["code", "principal"], registry=r)
        self.refused = Counter("splitllm_handshakes_refused", "Refused handshakes by reason", ["reason"], registry=r)
        self.dropped = Counter("splitllm_connections_dropped", "Connections the server ended, by reason", ["reason"],
                               registry=r)

    def total(self, name: str, **labels: str) -> float:
        """A sample summed over every principal (and any label not given)."""
        return sum(
            s.value
            for metric in self.registry.collect()
            for s in metric.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def render(self, principal: str | None = None) -> bytes:
        """The exposition text: everything (None), or only the samples labelled with `principal`."""
        return generate_latest(self.registry if principal is None else _Scoped(self.registry, principal))


class _Scoped:
    """A registry view holding only one principal's samples (what `generate_latest` needs: `collect`)."""

    def __init__(self, registry: CollectorRegistry, principal: str) -> None:
        self.registry, self.principal = registry, principal

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            samples = [s for s in metric.samples if s.labels.get("principal") == self.principal]
            if samples:
                scoped = Metric(metric.name, metric.documentation, metric.type, metric.unit)
                scoped.samples = samples
                yield scoped
