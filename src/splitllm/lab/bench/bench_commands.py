"""`splitllm bench ...`: each benchmark's options, then its run, its printed table and its files."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

import typer

from splitllm.commands.wiring import Values, command, fail, need_extra, numbers, parse_setting, sampling
from splitllm.options import (
    BENCH_CONFIDENTIAL, BENCH_CONVERSATION, BENCH_DEFAULTS, BENCH_EXACTNESS, BENCH_KERNELS, BENCH_LOAD, BENCH_QUALITY,
    BENCH_SPECULATION, BENCH_SPEED, BENCH_STREAMING, BENCH_STRUCTURED, BENCH_SUFFIX, BENCH_SWEEP,
)

app = typer.Typer(no_args_is_help=True, help="Benchmarks over the real client, server and WAN proxy.")


def _core_layout(cores: str) -> str:
    from splitllm.testing.launch import CORE_LAYOUTS

    if cores not in CORE_LAYOUTS:
        raise typer.BadParameter(f"--cores is one of {', '.join(CORE_LAYOUTS)}, not {cores!r}")
    return cores


def _models(model: str) -> tuple[str, ...]:
    return tuple(m.strip() for m in model.split(",") if m.strip())


def _progress(line: str) -> None:
    typer.echo(line, err=True)


def _command() -> str:
    """The command line that reproduces a report, recorded in it."""
    return shlex.join(["splitllm", *sys.argv[1:]])


def _provenance() -> dict:
    from splitllm.lab import results

    return results.provenance(_command())


def _write(result: dict, name: str, table: str, out: str, doc: str | None) -> None:
    """NAME.json and NAME.md into `out`; with `doc`, also published under docs/results/ and into docs/DOC's
    block, both under this CPU kind's name (`results.published_name`)."""
    import json

    from splitllm.lab import results

    text = json.dumps(result, indent=1) + "\n"
    published = results.published_name(name)
    for folder, stem in [(Path(out), name)] + ([(results.RESULTS, published)] if doc else []):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{stem}.json").write_text(text)
        (folder / f"{stem}.md").write_text(table)
    typer.echo(table)
    if doc:
        try:
            results.update_doc(results.CHECKOUT / "docs" / doc, published, table)
        except ValueError:
            fail(f"published docs/results/{published}.json, but docs/{doc} has no <!-- results:{published} --> "
                 "block to show it: add one and render the JSON into it (lab.results.update_doc)", code=2)


@command(app, BENCH_SPEED, speed=Values)
def speed(
    speed: Values, out: str, first: int, last: int, prompts_per_category: int, max_new_tokens: int, rtt_ms: str,
    wire_dtype: str,
) -> None:
    """Server forward per precision vs the memory-bandwidth floor, client step, loads, RSS, decoding, wire dtypes;
    writes runtime.json and runtime.md into --out.

    With --model: that model in-process and split per precision, the server's step in its own process, and
    llama.cpp (whole model, and its RPC backend behind the same emulated link) on the same GGUF (runtime-model.json)."""
    if speed.model:
        from splitllm.lab.bench.speed_model import MODEL_SETTINGS, run_model_speed

        path = Path(out, "runtime-model.json")
        rtts = numbers(rtt_ms, float)
        run_model_speed(
            speed.model, path, first, last, tuple(speed.settings.split(",")) if speed.settings else MODEL_SETTINGS,
            max(numbers(speed.threads, int)), max_new_tokens, rtts[-1], prompts_per_category, wire_dtype, _progress,
        )
        typer.echo(path.with_suffix(".md").read_text())
        typer.echo(f"wrote {path}", err=True)
        return
    from splitllm.lab.bench.speed import SETTINGS, SpeedBench, markdown, run_speed

    path = Path(out, "runtime.json")
    result = run_speed(SpeedBench(
        str(path), first, last, prompts_per_category, max_new_tokens, numbers(rtt_ms, float), wire_dtype,
        speed.dtype_prompts_per_category, tuple(speed.settings.split(",")) if speed.settings else SETTINGS,
        speed.fastest, numbers(speed.threads, int),
    ))
    typer.echo(markdown(result))
    typer.echo(f"wrote {path}", err=True)


@command(app, BENCH_QUALITY)
def quality(out: str, prompts_per_category: int, max_new_tokens: int, settings: str, ppl_positions: int) -> None:
    """Greedy agreement with float32 and perplexity on held-out text, per precision; writes quality.json and
    quality.md into --out."""
    from splitllm.lab.bench.quality import markdown, run_quality

    typer.echo(markdown(run_quality(tuple(settings.split(",")), prompts_per_category, max_new_tokens, ppl_positions,
                                    out)))


@command(app, BENCH_STREAMING)
def streaming(max_new_tokens: int, window: int, out: str) -> None:
    """The client's per-step bookkeeping (stop strings, detokenizing) at the first and last tokens of a long
    answer; writes streaming.json and streaming.md into --out."""
    from splitllm.lab.bench.streaming import run_streaming

    typer.echo(run_streaming(out, max_new_tokens, window)["markdown"])


@command(app, BENCH_SWEEP)
def sweep(
    out: str, links: str, prompts_per_category: int, max_new_tokens: int, profile: str | None, merge: bool,
    reanalyze: bool, max_other_cores: float, quiet_deadline_s: float, setting: str | None,
) -> None:
    """Tokens per second against RTT for every mode: measured, predicted (cross-validated), plotted; writes
    steps.json, sweep.json, sweep.md and the plots into --out."""
    from splitllm.lab.bench.sweep import Quiet
    from splitllm.lab.bench.sweep_report import sweep as run_sweep

    need_extra("bench")
    quiet = Quiet(max_other_cores, quiet_deadline_s)
    summary = run_sweep(out, links, prompts_per_category, max_new_tokens, profile, merge, reanalyze, _command(), quiet,
                        parse_setting(setting))
    typer.echo(summary["markdown"])
    typer.echo(f"overall MAPE {100 * summary['mape']['overall']:.2f}%; plots: {', '.join(summary['plots'])}", err=True)


@command(app, BENCH_SPECULATION, sampling=sampling, client=Values)
def speculation(
    sampling: Any, client: Values, prompts_per_category: int, max_new_tokens: int, rtt_ms: float, decode: str,
    out: str, setting: str | None, model: str, cores: str, publish: bool,
) -> None:
    """Tokens per round trip and speedup of each decoding mode through a server behind the WAN proxy; writes
    speculation.json and speculation.md into --out (--publish: the summary to docs/results/speculation.json,
    speculation-avx2.json on an AVX2-only CPU, and docs/drafting.md's table)."""
    from splitllm.decoding.modes import DECODERS
    from splitllm.lab.bench.speculation import EXTRA_DECODERS, SpeculationBench, report, run_speculation

    modes = tuple(m.strip() for m in decode.split(",") if m.strip())
    unknown = [m for m in modes if m not in DECODERS and m not in EXTRA_DECODERS]
    if unknown:
        raise typer.BadParameter(
            f"unknown modes {', '.join(unknown)}; choose from {', '.join([*DECODERS, *EXTRA_DECODERS])}"
        )
    _core_layout(cores)
    bench = SpeculationBench(
        prompts_per_category, max_new_tokens, rtt_ms, modes, out, sampling=sampling, wire_dtype=client.wire_dtype,
        drafter=client.drafter, precision=parse_setting(setting), model=model, core_layout=cores,
        draft_model=client.draft_model,
    )
    result = run_speculation(bench, _progress)
    if publish:
        _write({"provenance": _provenance(), **result}, "speculation", report(result), out, "drafting.md")
    else:
        typer.echo(report(result))


@command(app, BENCH_CONFIDENTIAL)
def confidential(
    model: str, rtt_ms: str, prompts_per_category: int, max_new_tokens: int, decode: str, cores: str, out: str,
    publish: bool,
) -> None:
    """What an attested, sealed session costs against the same split in the clear: tok/s, handshake, sealing;
    writes confidential.json and confidential.md into --out (--publish: also docs/results/ and
    docs/confidential.md's table)."""
    from splitllm.decoding.modes import DECODERS
    from splitllm.lab.bench.confidential import markdown, run_confidential

    modes = tuple(m.strip() for m in decode.split(",") if m.strip())
    if not modes or any(m not in DECODERS for m in modes):
        raise typer.BadParameter(f"--decode takes modes among {', '.join(DECODERS)}")
    result = {"provenance": _provenance()}
    result |= run_confidential(
        _models(model), numbers(rtt_ms, float), prompts_per_category, max_new_tokens, modes, _core_layout(cores),
        _progress
    )
    _write(result, "confidential", markdown(result), out, "confidential.md" if publish else None)


@command(app, BENCH_CONVERSATION)
def conversation(
    model: str, rtt_ms: float, first_turn_tokens: int, chats: int, cores: str, out: str, publish: bool,
) -> None:
    """A chat's follow-up turn through client-api: time to first token, continuing the conversation against
    fresh; writes conversation.json and conversation.md into --out (--publish: also docs/results/ and
    docs/usage.md's table)."""
    from splitllm.lab.bench.conversation import markdown, run_conversation

    result = {"provenance": _provenance()}
    result |= run_conversation(_models(model), rtt_ms, first_turn_tokens, chats, _core_layout(cores), _progress)
    _write(result, "conversation", markdown(result), out, "usage.md" if publish else None)


@command(app, BENCH_SUFFIX)
def suffix(
    model: str, rtt_ms: float, max_new_tokens: int, prompts_per_category: int, cores: str, out: str, publish: bool
) -> None:
    """A coding session's requests, the same again, and the workload's prompts, with drafting from earlier
    requests off and on: tokens per step, tok/s and client CPU per token; writes suffix.json and suffix.md
    into --out (--publish: also docs/results/ and docs/drafting.md's table)."""
    from splitllm.lab.bench.suffix import markdown, run_suffix

    result = {"provenance": _provenance()}
    result |= run_suffix(_models(model), rtt_ms, max_new_tokens, prompts_per_category, _core_layout(cores), _progress)
    _write(result, "suffix", markdown(result), out, "drafting.md" if publish else None)


@command(app, BENCH_STRUCTURED)
def structured(model: str, rtt_ms: float, max_tokens: int, cores: str, out: str, publish: bool) -> None:
    """JSON schemas and tool calls through client-api (validity, auto against sequential) and the grammar's
    mask cost; writes structured.json and structured.md into --out (--publish: also docs/results/ and
    docs/usage.md's table)."""
    from splitllm.lab.bench.structured import markdown, run_structured

    result = {"provenance": _provenance()}
    result |= run_structured(_models(model), rtt_ms, max_tokens, _core_layout(cores), _progress)
    _write(result, "structured", markdown(result), out, "usage.md" if publish else None)


@command(app, BENCH_KERNELS)
def kernels(
    model: str, max_new_tokens: int, settings: str | None, variants: str | None, prompts: int, out: str, publish: bool
) -> None:
    """The whole model in one process on one core per CPU kernel variant and setting, beside llama.cpp built
    for the same instructions; writes kernels.json and kernels.md into --out (--publish: also docs/results/,
    as kernels-avx2.json on an AVX2-only CPU, and docs/precision.md's table)."""
    from splitllm.lab.bench.kernels import SETTINGS, KernelsBench, markdown, run_kernels

    bench = KernelsBench(_models(model), _models(variants or ""), _models(settings) if settings else SETTINGS, prompts,
                         max_new_tokens)
    try:
        result = {"provenance": _provenance()} | run_kernels(bench, _progress)
    except ValueError as exc:
        fail(exc, code=2)
    _write(result, "kernels", markdown(result), out, "precision.md" if publish else None)


@command(app, BENCH_EXACTNESS)
def exactness(prompts_per_category: int, max_new_tokens: int, out: str, model: str, setting: str | None) -> None:
    """Every speculative mode against sequential greedy on the real model; divergences with their logit gaps;
    writes exactness.json and exactness.md into --out."""
    from splitllm.lab.bench.exactness import NEAR_TIE, run_exactness

    report = run_exactness(prompts_per_category, max_new_tokens, out, model, parse_setting(setting))
    typer.echo(report.markdown())
    if not report.explained:
        fail(f"a divergence at a top-2 logit gap >= {NEAR_TIE} is not a rounding effect", code=1)


@command(app, BENCH_DEFAULTS)
def defaults(out: str, prompts_per_category: int, max_new_tokens: int, rtt_ms: float) -> None:
    """`serve` + `generate` with no precision or thread options against the fastest setting and threads named;
    writes defaults.json and defaults.md into --out."""
    from splitllm.lab.bench.defaults import run_defaults

    typer.echo(run_defaults(out, prompts_per_category, max_new_tokens, rtt_ms, _progress)["markdown"])


@command(app, BENCH_LOAD, load=Values, server=Values)
def load(load: Values, server: Values, max_new_tokens: int, rtt_ms: float, out: str) -> None:
    """Concurrent clients through the WAN proxy: correctness, step latency p50/p99, tokens/s, KV bound; writes
    load.json, load.md and load.png into --out (--prefill: prefill.json and prefill.md)."""
    from splitllm.lab.bench.load import LoadSettings, ServerKind, run_load

    need_extra("bench")
    counts, windows = numbers(load.clients, int), numbers(load.batch_window_ms, float)
    replicas = numbers(load.ray_replicas, int)
    if load.clients_compute not in ("device", "real"):
        raise typer.BadParameter("--clients-compute is device or real")
    if not counts or min(counts) < 1 or any(r < 1 for r in replicas) or any(w < 0 for w in windows):
        raise typer.BadParameter("client and replica counts are at least 1, windows at least 0")
    if replicas:
        need_extra("ray")
    on = max(windows, default=2.0) or 2.0
    settings = LoadSettings(
        max_new_tokens=max_new_tokens, rtt_ms=rtt_ms, prompts=load.prompts, context=server.max_context,
        max_kv_gib=server.max_kv_gib, clients_compute="device" if load.prefill > 0 else load.clients_compute,
    )
    if load.prefill > 0:
        _prefill(max(counts), load.prefill, settings, on, server, out)
        return
    kinds = [ServerKind(w) for w in windows] + [ServerKind(on, r) for r in replicas]
    result = run_load(counts, kinds, settings, out, _command(), progress=_progress)
    typer.echo(Path(out, "load.md").read_text())
    typer.echo(f"wrote {out}/load.json, load.md, load.png", err=True)
    failed = [r for r in result["rows"] if r["errors"] or r["correct_clients"] != r["clients"]]
    if failed or not result["kv_within_bound"]:
        raise typer.Exit(1)


def _prefill(clients: int, positions: int, settings: Any, window_ms: float, server: Values, out: str) -> None:
    """`bench load --prefill`: the decoders alone, then beside one prompt of `positions`; exit 1 on a wrong answer."""
    from splitllm.lab.bench.load import run_prefill
    from splitllm.lab.bench.load_report import prefill_markdown

    serve_args = [
        "--max-nodes-per-step", str(server.max_nodes_per_step), "--max-batch-rows", str(server.max_batch_rows),
        "--slice-rows", str(server.slice_rows),
    ]
    result = run_prefill(clients, positions, settings, window_ms, serve_args, out, _command(), progress=_progress)
    typer.echo(prefill_markdown(result))
    typer.echo(f"wrote {out}/prefill.json, prefill.md", err=True)
    rows = (result["alone"], result["with_prefill"])
    if not result["prefill_ok"] or any(r["errors"] or r["correct_clients"] != r["clients"] for r in rows):
        raise typer.Exit(1)
