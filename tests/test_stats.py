"""A step's record: its two parts publish one flat dict in a fixed order, and speculation sums over steps."""

from __future__ import annotations

import dataclasses

import pytest

from splitllm.stats import SpeculationMetrics, StepSpeculation, StepStats, StepTiming, mean_stats

# What API responses and saved results carry per step, in this order.
PUBLISHED = [
    "nodes", "accepted", "drafted", "window", "proposer", "sources", "draft_ms", "overlap_ms", "prepared", "adopted",
    "sent_ahead", "ran_ahead",
    "first_ms", "serialize_ms", "round_trip_ms", "server_ms", "deserialize_ms", "last_ms", "decode_ms", "total_ms",
    "bytes_up", "bytes_down", "context", "network_ms", "client_ms", "other_ms",
]


def _step(accepted: int, drafted: int, sources: dict[str, int], total_ms: float = 10.0) -> StepStats:
    timing = StepTiming(1 + drafted, 50, first_ms=1.0, round_trip_ms=6.0, server_ms=4.0, total_ms=total_ms)
    proposer = next(iter(sources), "")
    return StepStats(timing, StepSpeculation(accepted, drafted, 0, proposer, sources))


def test_the_flat_record_keeps_the_published_keys_and_reads_back() -> None:
    step = _step(3, 5, {"lookup": 2})
    flat = step.as_dict()
    assert list(flat) == PUBLISHED
    assert (flat["network_ms"], flat["client_ms"], flat["other_ms"]) == (2.0, 1.0, 3.0)
    assert StepStats.from_flat(flat) == step and StepStats.from_flat(step.flat()) == step
    partial = StepStats.from_flat({"accepted": 2, "total_ms": 5.0})  # older results lack some keys
    assert partial == StepStats(StepTiming(total_ms=5.0), StepSpeculation(2))
    means = mean_stats([step, _step(1, 0, {}, total_ms=20.0)])
    assert list(means) == [k for k in PUBLISHED if k not in ("proposer", "sources")]
    assert means["accepted"] == 2.0 and means["total_ms"] == 15.0


def test_speculation_is_built_once_and_clipped_by_copy() -> None:
    step = _step(3, 5, {"lookup": 2})
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.speculation.accepted = 1  # type: ignore[misc]
    clipped = dataclasses.replace(step, speculation=dataclasses.replace(step.speculation, accepted=1))
    assert clipped.timing is step.timing and step.speculation.accepted == 3
    assert clipped.speculation.sources == {"lookup": 2}  # what the model confirmed stays


def test_speculation_metrics_sum_the_steps() -> None:
    steps = [_step(1, 0, {}), _step(3, 6, {"lookup": 2}), _step(2, 4, {"draft": 1})]
    steps.append(_step(4, 6, {"draft": 2, "draft+lookup": 1}))
    m = SpeculationMetrics.of(steps)
    assert (m.steps, m.tokens, m.drafted, m.accepted_drafts) == (4, 10, 16, 6)
    assert m.sources == {"lookup": 2, "draft": 3, "draft+lookup": 1}
    assert m.tokens == m.accepted_drafts + m.steps  # a step emits its accepted drafts and one token more
    assert (m.acceptance_rate, m.tokens_per_step, m.efficiency) == (6 / 16, 2.5, 10 / 20)
    none = SpeculationMetrics.of([])
    assert (none.tokens_per_step, none.acceptance_rate, none.efficiency) == (0.0, 0.0, 0.0)
