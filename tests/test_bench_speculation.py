"""`splitllm bench speculation`: its summary arithmetic, and a short real run through the server and proxy."""

from __future__ import annotations

import json
import os

import pytest
from report_tables import table, values

from splitllm.lab.bench.speculation import (
    EXTRA_DECODERS,
    SpeculationBench,
    markdown,
    report,
    run_speculation,
    summarize,
)
from splitllm.lab.data.workload import CATEGORIES, workload
from splitllm.testing.launch import sides


def _step(accepted: int, ms: float, proposer: str = "", **more: int) -> dict:
    return {"accepted": accepted, "total_ms": ms, "nodes": 1 + 2 * (accepted > 1), "bytes_up": 10, "bytes_down": 10,
            "proposer": proposer, "server_ms": ms / 4, **more}


SETTINGS = {"rtt_ms": 80, "first": 2, "last": 2, "max_new_tokens": 4, "prompts_per_category": 1, "sampling": "greedy",
            "cores": {"layout": "halves", "threads": 1}}


def test_summary_counts_decode_steps_against_sequential_of_the_same_prompts() -> None:
    prefill = _step(1, 500.0)
    runs = [
        {"prompt": 0, "category": "code", "mode": "sequential", "ids": [1, 2, 3, 4],
         "steps": [prefill] + [_step(1, 100.0)] * 3},
        {"prompt": 0, "category": "code", "mode": "lookup", "ids": [1, 2, 3, 4],
         "steps": [prefill, _step(3, 120.0, "lookup")]},
        {"prompt": 1, "category": "creative", "mode": "sequential", "ids": [5, 6], "steps": [prefill, _step(1, 100.0)]},
        {"prompt": 1, "category": "creative", "mode": "lookup", "ids": [5, 7], "steps": [prefill, _step(1, 110.0)]},
    ]
    summary = summarize(runs, ("sequential", "lookup"))
    assert list(summary) == ["code", "creative", "overall"]
    code = summary["code"]["lookup"]
    assert code["tokens_per_step"] == 3.0 and code["identical"] == 1
    assert code["speedup"] == pytest.approx((3 / 120) / (3 / 300))
    assert code["proposers"] == {"lookup": {"steps_won": 1, "draft_tokens_accepted": 2}}
    overall = summary["overall"]["lookup"]
    assert overall["tokens"] == 4 and overall["steps"] == 2 and overall["identical"] == 1
    assert overall["server_ms_per_step"] == pytest.approx((120 + 110) / 4 / 2)
    assert overall["first_step_ms"] == 500.0  # the prefill steps: the first token's wait, apart from the rest
    text = markdown(summary, {**SETTINGS, "cores": {"layout": "alternate", "threads": 2}})
    assert "2 threads a side, both sides on every core" in text
    by_mode = table(text, "tokens/step")
    assert [(row["category"], row["mode"]) for row in by_mode] == [
        (group, mode) for group in summary for mode in summary[group]
    ]
    shown = values(by_mode[-1])  # overall, lookup
    assert (shown["tokens/step"], shown["identical"], shown["server ms/step"], shown["first token ms"]) == (
        [2.0], [1, 2], [28.8], [500])
    assert [values(row) for row in table(text, "proposer")] == [
        {"mode": "lookup", "proposer": "lookup", "steps won": [1], "draft tokens accepted": [2],
         "share of tokens": [50.0]}
    ]


def _ahead_runs() -> list[dict]:
    """Sequential in records that predate the sent-ahead fields, auto sending three of its four steps ahead:
    the second and the fourth ran on a guess that held, the third on one that failed."""
    prefill = _step(1, 500.0, sent_ahead=1)  # the prefill step is not a decode step: left out of the shares
    auto = [_step(2, 90.0, sent_ahead=1), _step(3, 90.0, sent_ahead=1, ran_ahead=1), _step(1, 90.0, sent_ahead=1),
            _step(2, 90.0, ran_ahead=1)]
    return [
        {"prompt": 0, "category": "code", "mode": "sequential", "ids": [1] * 8,
         "steps": [_step(1, 500.0)] + [_step(1, 100.0)] * 8},
        {"prompt": 0, "category": "code", "mode": "auto", "ids": [1] * 8, "steps": [prefill, *auto]},
    ]


def test_summary_shares_steps_sent_ahead_and_those_whose_guess_held() -> None:
    summary = summarize(_ahead_runs(), ("sequential", "auto"))
    auto, sequential = summary["overall"]["auto"], summary["overall"]["sequential"]
    assert auto["ahead_share"] == pytest.approx(3 / 4) and auto["ahead_used_share"] == pytest.approx(2 / 3)
    assert sequential["ahead_share"] == 0.0 and sequential["ahead_used_share"] == 0.0  # none sent: no division by zero
    assert EXTRA_DECODERS["auto-one-step"]().config.send_ahead is False
    assert EXTRA_DECODERS["auto-one-step"]().config.prepare is True


def test_report_shows_steps_sent_ahead_and_llama_cpp_whole_model_only_where_measured() -> None:
    summary = summarize(_ahead_runs(), ("sequential", "auto"))
    rpc = {"skipped": "no llama.cpp build"}
    whole = {"1": {"name": "llama.cpp whole model", "tokens_per_second": 4.0, "threads": 1},
             "2": {"skipped": "no llama.cpp build here"}}
    text = report({"settings": SETTINGS, "summary": summary, "divergences": [], "llama_cpp_rpc": rpc,
                   "llama_cpp_whole": whole})
    rows = {(row["category"], row["mode"]): row for row in table(text, "steps sent ahead used")}
    assert rows[("overall", "auto")]["steps sent ahead used"] == "67% of 75%"
    assert rows[("overall", "sequential")]["steps sent ahead used"] == "0% of 0%"
    auto_tps = summary["overall"]["auto"]["tokens_per_second"]
    assert f"llama.cpp whole model, 1 thread (pinned to the client's cores, every layer local, no link): 4.00 tok/s; " \
           f"auto is {auto_tps / 4:.2f}x that." in text
    assert "llama.cpp whole model, 2 threads: no llama.cpp build here" in text
    # results saved before these were measured: no such column, no such lines, every other column as before
    old = {group: {mode: {k: v for k, v in s.items() if not k.startswith("ahead")} for mode, s in modes.items()}
           for group, modes in summary.items()}
    text = report({"settings": SETTINGS, "summary": old, "divergences": [], "llama_cpp_rpc": rpc})
    by_mode = table(text, "prepared trees used")
    assert "steps sent ahead used" not in by_mode[0] and len(by_mode[0]) == 14
    assert "whole model" not in text and text.endswith("llama.cpp RPC: no llama.cpp build\n")


def test_core_layouts_give_each_side_its_own_half_or_both_every_core() -> None:
    cores = os.sched_getaffinity(0)
    halves, alternate = sides("halves"), sides("alternate")
    assert halves.server | halves.client == cores and halves.threads == len(halves.server) >= 1
    assert len(cores) < 2 or not halves.server & halves.client
    assert alternate.server == alternate.client == cores and alternate.threads == len(cores)
    with pytest.raises(ValueError, match="halves, alternate"):
        sides("quarters")


def test_workload_has_every_category() -> None:
    prompts = workload(3)
    assert [p.category for p in prompts] == [c for c in CATEGORIES for _ in range(3)]
    assert len({p.text for p in workload()}) == 32


@pytest.mark.slow
def test_a_short_run_through_server_and_proxy(tmp_path) -> None:  # type: ignore[no-untyped-def]
    result = run_speculation(SpeculationBench(1, 6, rtt_ms=10, modes=("lookup", "drafter-wide", "auto-wide"),
                                              out=tmp_path))
    overall = result["summary"]["overall"]
    assert set(overall) == {"sequential", "lookup", "drafter-wide", "auto-wide"}
    assert overall["auto-wide"]["identical"] == 4
    assert overall["sequential"]["tokens_per_step"] == 1.0 and overall["lookup"]["prompts"] == 4
    # wider than drafter's 24
    assert overall["drafter-wide"]["identical"] == 4 and overall["drafter-wide"]["nodes_per_step"] > 24
    data = json.loads((tmp_path / "speculation.json").read_text())
    assert len(data["runs"]) == 16 and (tmp_path / "speculation.md").read_text().startswith("Speculative decoding")
