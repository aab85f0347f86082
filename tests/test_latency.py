"""The latency model: fitting recovers known coefficients; the step decomposition adds up on a real run."""

from __future__ import annotations

import random
import statistics

import pytest

from splitllm.lab.bench.sweep import ADAPTIVE, POINTS, Config, Run, fixed_configs
from splitllm.lab.bench.sweep_report import load_runs, write
from splitllm.client.client import SplitClient
from splitllm.decoding.sizing.latency import LatencyProfile, Link, StepRecord, StepShape, ideal_tokens_per_second
from splitllm.stats import StepSpeculation, StepStats, StepTiming

# Coefficients of a made-up machine pair: ms = a + b*nodes + c*context + d*nodes*context (+ ...).
LOCAL = {"1": 5.0, "nodes": 0.45, "single": -0.7, "context": 0.004, "nodes*context": 0.0006, "accepted": 4.1,
         "windowed": 9.0}
SERVER = {"1": 22.0, "nodes": 0.8, "single": -2.5, "context": 0.01, "nodes*context": 0.0011}
OVERHEAD = {"1": 0.15, "bytes": 2e-5, "context": 0.0004}
FRAMING = {"1": 1.1, "bytes": 4e-5}
DECODE = {"1": 0.3, "nodes": 0.05, "accepted": 0.2}
UP, DOWN = {"1": 90.0, "nodes": 1160.0}, {"1": 40.0, "nodes": 1152.0}
LINKS = [Link(0.0), Link(21.3), Link(81.7), Link(122.0), Link(81.2, 20.0)]


def _lin(coef: dict[str, float], x: dict[str, float]) -> float:
    return sum(c * x[k] for k, c in coef.items())


def _synthetic(n: int, noise: float, seed: int = 0) -> list[StepRecord]:
    """Steps generated from the coefficients above, each time part scaled by (1 + U(-noise, noise))."""
    rng = random.Random(seed)

    def jitter(v: float) -> float:
        return v * (1 + rng.uniform(-noise, noise))

    records = []
    for i in range(n):
        nodes, context = rng.choice([1, rng.randint(2, 64)]), rng.randint(16, 900)
        window, accepted = rng.choice([0, nodes - 1]), rng.randint(1, min(nodes, 6))
        x = {"1": 1.0, "nodes": nodes, "single": float(nodes == 1), "context": context,
             "nodes*context": nodes * context, "accepted": accepted, "windowed": float(window > 0)}
        up, down = round(_lin(UP, x)), round(_lin(DOWN, x))
        x["bytes"] = up + down
        link = LINKS[i % len(LINKS)]
        server = jitter(_lin(SERVER, x))
        network = link.rtt_ms + link.transfer_ms(up + down) + jitter(_lin(FRAMING, x))
        local = jitter(_lin(LOCAL, x))
        overhead = jitter(_lin(OVERHEAD, x))
        decode = jitter(_lin(DECODE, x))
        t = StepTiming(
            nodes=nodes, first_ms=0.2 * local, last_ms=0.8 * local, serialize_ms=overhead / 2,
            deserialize_ms=overhead / 2, round_trip_ms=server + network, server_ms=server, decode_ms=decode,
            bytes_up=up, bytes_down=down, context=context,
        )
        t.total_ms = t.client_ms + t.round_trip_ms
        records.append(StepRecord(StepStats(t, StepSpeculation(accepted=accepted, window=window)), link, "tree"))
    return records


def _assert_close(fit: dict[str, float], truth: dict[str, float], rel: float) -> None:
    for k, v in truth.items():
        assert fit[k] == pytest.approx(v, rel=rel), (k, fit, truth)


@pytest.mark.parametrize("noise", [0.0, 0.005])
def test_fit_recovers_known_coefficients(noise: float) -> None:
    profile = LatencyProfile.fit(_synthetic(4000, noise))
    _assert_close(profile.local.as_dict(), LOCAL, 0.01)
    _assert_close(profile.server.as_dict(), SERVER, 0.01)
    _assert_close(profile.overhead.as_dict(), OVERHEAD, 0.01)
    _assert_close(profile.framing.as_dict(), FRAMING, 0.01)
    _assert_close(profile.decode["tree"].as_dict(), DECODE, 0.01)
    # Bytes are rounded to whole bytes, which costs a little precision on the intercept only.
    _assert_close(profile.wire_up.as_dict(), UP, 0.01)
    _assert_close(profile.wire_down.as_dict(), DOWN, 0.01)


def test_prediction_matches_the_generating_model_and_survives_json(tmp_path) -> None:  # type: ignore[no-untyped-def]
    records = _synthetic(2000, 0.0)
    profile = LatencyProfile.fit(records)
    path = tmp_path / "profile.json"
    profile.save(path)
    loaded = LatencyProfile.load(path)
    assert loaded.to_json() == profile.to_json()
    link = Link(200.0, 50.0)  # an RTT and a bandwidth the fit never saw
    for nodes, context in [(1, 100), (16, 400), (48, 800)]:
        shape = StepShape.at(nodes, context, accepted=2.0, windowed=0.5)
        x = {"1": 1.0, "nodes": nodes, "single": float(nodes == 1), "context": context,
             "nodes*context": nodes * context, "accepted": 2.0, "windowed": 0.5}
        wire = _lin(UP, x) + _lin(DOWN, x)
        x["bytes"] = wire
        truth = (
            _lin(LOCAL, x) + _lin(SERVER, x) + _lin(OVERHEAD, x) + _lin(DECODE, x) + _lin(FRAMING, x)
            + link.rtt_ms + link.transfer_ms(wire)
        )
        got = loaded.predict(shape, link, "tree")
        assert got.total == pytest.approx(truth, rel=1e-3)
        assert got.tokens_per_second == pytest.approx(2.0 / truth * 1000, rel=1e-3)


def test_shape_means_make_the_linear_model_exact() -> None:
    """Predicting from a workload's mean features equals averaging per-step predictions."""
    records = _synthetic(300, 0.0, seed=3)
    profile = LatencyProfile.fit(records)
    link = Link(40.0)
    steps = [r.stats for r in records]
    whole = profile.predict(StepShape.of(steps), link, "tree").total
    per_step = sum(profile.predict(StepShape.of([s]), link, "tree").total for s in steps) / len(steps)
    assert whole == pytest.approx(per_step, rel=1e-9)


def test_ideal_speed_counts_only_link_and_compute() -> None:
    t = StepTiming(nodes=4, first_ms=2, last_ms=8, server_ms=20, decode_ms=1, round_trip_ms=75,
                   serialize_ms=1, deserialize_ms=1, bytes_up=5000, bytes_down=5000, total_ms=100)
    s = StepStats(t, StepSpeculation(accepted=3))
    # 50 ms RTT + 10 kB at 8 Mbit/s (10 ms) + 31 ms of compute = 91 ms for 3 tokens.
    assert ideal_tokens_per_second([s], Link(50.0, 8.0)) == pytest.approx(3 / 0.091)


@pytest.mark.slow
def test_step_decomposition_adds_up_on_a_loopback_run(server) -> None:  # type: ignore[no-untyped-def]
    """Real server over real sockets: every part is filled, the parts sum to the steps' wall time, and
    the steps' wall times cover the whole generation (nothing is lost between steps)."""
    url = server(None, 2, 2).url
    client = SplitClient(None, server=url, first=2, last=2)
    gen = client.generate("Name three primary colors.", max_new_tokens=24, decode="sequential")
    times = [s.timing for s in gen.steps]
    prefill, steps = times[0], times[1:]
    assert prefill.nodes == len(gen.prompt_ids) and len(steps) >= 8
    assert all(s.speculation.accepted == 1 for s in gen.steps)
    for t in times:
        assert min(t.first_ms, t.last_ms, t.serialize_ms, t.deserialize_ms, t.decode_ms, t.server_ms) > 0
        assert t.round_trip_ms > t.server_ms and t.bytes_up > 0 and t.bytes_down > 0
    assert [t.context for t in steps] == list(range(len(gen.prompt_ids), len(gen.prompt_ids) + len(steps)))
    total = sum(t.total_ms for t in times)
    parts = sum(t.first_ms + t.serialize_ms + t.round_trip_ms + t.deserialize_ms + t.last_ms + t.decode_ms
                for t in times)
    # What no part accounts for is the client's bookkeeping (detokenizing, stop rules): about 0.2 ms, near 2%
    # of a step of this tiny split, so the bound leaves room for a busy machine, not for a part left untimed.
    assert parts == pytest.approx(total, rel=0.05)
    assert statistics.median(t.other_ms / t.total_ms for t in times) < 0.05
    assert total == pytest.approx(gen.seconds * 1000, rel=0.02)
    mean = gen.summary()["mean_step"]
    assert mean["total_ms"] == pytest.approx(sum(t.total_ms for t in steps) / len(steps))


def test_sweep_report_cross_validates_and_plots(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Runs generated by a known model: leave-one-link-out predicts every run, the report is written."""
    truth = LatencyProfile.fit(_synthetic(3000, 0.0))
    truth.decode.update({name: truth.decode["tree"] for name in ("sequential", "lookahead", "lookup", "auto")})
    configs = [*fixed_configs(), Config(ADAPTIVE, "auto")]
    yields = {c.label: (1.0 + 1.5 * i, 1.0 + 0.15 * i) for i, c in enumerate(configs)}  # (nodes, tokens)
    runs = []
    for point in POINTS:
        link = Link(point.rtt_ms + 1.5, point.bandwidth_mbit)
        for config in configs:
            if config.adaptive:  # what the policy would pick: the best candidate on this link
                best = max((c for c in configs if c.label.startswith("auto/") or c.label == "sequential"),
                           key=lambda c: _speed(truth, yields[c.label], link))
                nodes, tokens = yields[best.label]
            else:
                nodes, tokens = yields[config.label]
            run = Run(point, config, link.rtt_ms)
            run.steps = [_exact_step(truth, nodes, tokens, 100 + 3 * k, link) for k in range(20)]
            runs.append(run)
    summary = write(runs, tmp_path, "splitllm bench sweep")
    assert summary["mape"]["overall"] < 1e-6
    assert all(v["ratio"] == pytest.approx(1.0) for v in summary["auto_vs_best_fixed"])
    assert all(r["fraction_of_ideal"] < 1 for r in summary["runs"])
    for name in ("sweep.json", "sweep.md", "steps.json", "tok_s_vs_rtt.png", "step_decomposition.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert load_runs(tmp_path / "steps.json")[0].steps == runs[0].steps


def _exact_step(profile: LatencyProfile, nodes: float, tokens: float, context: int, link: Link) -> StepStats:
    shape = StepShape.at(nodes, context, tokens)
    p = profile.predict(shape, link, "tree")
    up, down = profile.bytes(shape)
    t = StepTiming(nodes=nodes, first_ms=p.local, serialize_ms=p.overhead, server_ms=p.server,
                   round_trip_ms=p.server + p.rtt + p.transfer + p.framing, decode_ms=p.decode,
                   bytes_up=up, bytes_down=down, context=context)
    t.total_ms = t.client_ms + t.round_trip_ms
    return StepStats(t, StepSpeculation(accepted=tokens))


def _speed(profile: LatencyProfile, yields: tuple[float, float], link: Link) -> float:
    return profile.predict(StepShape.at(yields[0], 100, yields[1]), link, "tree").tokens_per_second
