"""Cross-session batching: steps of concurrent sessions share a forward pass and give the same results.

Hidden states agree to float32 rounding (a multi-row product may sum in another order than a one-row
product), and greedy tokens are identical."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import TINY_SPLIT
from report_tables import table, values

from splitllm.model.stage import Stage, Step
from splitllm.weights.sources import ModelFiles
from splitllm.model.visibility import Visibility
from protocol_client import RawClient

FIRST, LAST = TINY_SPLIT


def _session_steps(hidden_size: int, seed: int) -> list[tuple[torch.Tensor, list[int], Visibility, list[int]]]:
    """A prefill of a seed-dependent length, then a tree step and a chain step keeping part of it."""
    g = torch.Generator().manual_seed(seed)
    prompt = 3 + seed % 5
    tree = Visibility.from_parents([-1, 0, 0, 1, -1][: 2 + seed % 4])
    steps = [(torch.randn(prompt, hidden_size, generator=g), list(range(prompt)), Visibility.chain(prompt), [])]
    steps.append((torch.randn(tree.n, hidden_size, generator=g), [prompt + d for d in _depths(tree)], tree,
                  list(range(prompt))))
    kept = [0, 1] if tree.parents[1] == 0 else [0]
    start = prompt + len(kept)
    steps.append((torch.randn(2, hidden_size, generator=g), [start, start + 1], Visibility.chain(2), kept))
    return steps


def _depths(vis: Visibility) -> list[int]:
    return [int(vis.matrix[i].sum()) - 1 for i in range(vis.n)]


def test_forward_many_matches_one_by_one(tiny_models) -> None:  # type: ignore[no-untyped-def]
    files = ModelFiles(tiny_models["mistral"])  # sliding window: per-layer masks per segment
    stage = Stage.load(files, FIRST, files.config.num_layers - LAST, torch.float32)
    sessions = [_session_steps(files.config.hidden_size, seed) for seed in range(8)]
    solo = [stage.new_cache(32) for _ in sessions]
    batched = [stage.new_cache(32) for _ in sessions]
    for k in range(3):
        inputs = [Step(h, torch.tensor(pos), vis, keep) for h, pos, vis, keep in (steps[k] for steps in sessions)]
        want = [stage(c, step) for c, step in zip(solo, inputs)]
        got = stage.forward_many(list(zip(batched, inputs)))
        for a, b in zip(want, got):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    for a, b in zip(solo, batched):
        assert (a.length, a.pending) == (b.length, b.pending)
        torch.testing.assert_close(b.k[:, :, :, : b.length + b.pending], a.k[:, :, :, : a.length + a.pending])


def test_eight_concurrent_sessions_are_batched_and_match_solo_runs(tiny_models,  # type: ignore[no-untyped-def]
                                                                   server) -> None:
    files = ModelFiles(tiny_models["qwen2"])
    layers = (FIRST, files.config.num_layers - LAST)
    sessions = [_session_steps(files.config.hidden_size, seed) for seed in range(8)]

    def run(url: str, steps: list) -> list[torch.Tensor]:  # type: ignore[type-arg]
        with RawClient(url) as client:
            sid = client.open(files, layers).session  # type: ignore[union-attr]
            return [client.step(sid, h, pos, keep, vis).hidden for h, pos, vis, keep in steps]  # type: ignore[union-attr]

    solo_url = server(tiny_models["qwen2"], FIRST, LAST, batch_window_ms=0).url
    want = [run(solo_url, steps) for steps in sessions]
    batching = server(tiny_models["qwen2"], FIRST, LAST, batch_window_ms=200)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda steps: run(batching.url, steps), sessions))
    for a_steps, b_steps in zip(want, got):
        for a, b in zip(a_steps, b_steps):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    histogram = batching.server.metrics.batch_size.collect()[0].samples
    total = next(s.value for s in histogram if s.name.endswith("_sum"))
    count = next(s.value for s in histogram if s.name.endswith("_count"))
    assert count < total, "concurrent steps should have shared forward passes"


@pytest.mark.slow
def test_batched_greedy_decoding_equals_solo_on_the_default_model(  # type: ignore[no-untyped-def]
    default_files, load_client_model, server, split_greedy
) -> None:
    client_model = load_client_model(None, 2, 2)
    prompts = [[1, 504, 3458, 282, 4649, 314] + [28 + i] * (i + 1) for i in range(8)]
    url = server(None, 2, 2, batch_window_ms=20).url
    solo = [split_greedy(client_model, url, p, 16) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: split_greedy(client_model, url, p, 16), prompts))
    assert together == solo


def test_load_report_scales_each_server_against_its_own_single_client(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from splitllm.lab.bench.load_report import markdown, plot, scaling

    def row(server: str, clients: int, tps: float, p50: float) -> dict:
        return {"server": server, "clients": clients, "correct_clients": clients, "aggregate_tokens_per_s": tps,
                "step_ms": {"p50": p50, "p99": 2 * p50}, "server_compute_ms": {"p50": 30.0}}

    rows = [row("no batching", 1, 6.0, 120.0), row("no batching", 16, 24.0, 600.0),
            row("batching 2 ms", 1, 7.0, 120.0), row("batching 2 ms", 16, 35.0, 180.0)]
    factors = scaling(rows)
    assert factors == [
        {"server": "no batching", "clients": 16, "throughput_x": 4.0, "p50_step_x": 5.0},
        {"server": "batching 2 ms", "clients": 16, "throughput_x": 5.0, "p50_step_x": 1.5},
    ]
    text = markdown({"command": "splitllm bench load", "settings": {"clients_compute": "device"}, "rows": rows,
                     "scaling": factors})
    shown = [values(r) for r in table(text, "server")]
    assert [(r["server"], r["clients"]) for r in shown] == [(r["server"], [r["clients"]]) for r in rows]
    assert shown[-1] == {"server": "batching 2 ms", "clients": [16], "match solo": [16, 16], "tok/s": [35.0],
                         "vs 1 client": [5.0],
                         "step p50 / p99 ms": [180.0, 360.0], "p50 vs 1 client": [1.5], "server compute p50 ms": [30.0]}
    # each single client is its own 1x
    assert [r["vs 1 client"] + r["p50 vs 1 client"] for r in shown[::2]] == [[1.0, 1.0]] * 2
    plot(rows, tmp_path / "load.png")
    assert (tmp_path / "load.png").stat().st_size > 0


def _schedule(items: list[tuple[str, int, int]], max_rows: int) -> list[list[str]]:
    """Names per forward of a StepBatcher fed (name, principal index, rows) items at once; an item
    named with '*' has one more part after its first forward (it is queued again)."""
    import asyncio

    from splitllm.server.batching import StepBatcher

    forwards: list[list[str]] = []
    again: set[str] = {name for name, _, _ in items if name.endswith("*")}

    def run(batch: list[tuple[str, int, int]]) -> list[bytes | None]:
        forwards.append([name for name, _, _ in batch])
        replies: list[bytes | None] = []
        for name, _, _ in batch:
            replies.append(None if name in again else name.encode())
            again.discard(name)
        return replies

    async def main() -> None:
        with ThreadPoolExecutor(1) as pool:
            batcher = StepBatcher(run, pool, 0.05, lambda: len(items), owner=lambda i: f"p{i[1]}",
                                  cost=lambda i: (i[2], 0), max_rows=max_rows)
            assert [r.decode() for r in await asyncio.gather(*(batcher.submit(i) for i in items))] == [n for n, _,
                                                                                                       _ in items]

    asyncio.run(main())
    return forwards


def test_batches_are_capped_and_principals_take_turns() -> None:
    # principal 0 queued four 1-row steps before principal 1's one: both get into the first forward
    assert _schedule([("a1", 0, 1), ("a2", 0, 1), ("a3", 0, 1), ("a4", 0, 1), ("b1", 1, 1)], 3) == [
        ["a1", "b1", "a2"], ["a3", "a4"]]
    # a step with parts left goes behind the steps waiting meanwhile; a step over the cap runs alone
    assert _schedule([("long*", 0, 8), ("b1", 1, 1), ("c1", 2, 1)], 4) == [["long*"], ["b1", "c1"], ["long*"]]
