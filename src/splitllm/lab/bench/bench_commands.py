"""`splitllm bench ...`: each benchmark's options, then its run, its printed table and its files."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from splitllm.commands.options import (
    Head, Model, RttMs, Setting, Tail, WireDtypeName, fail, need_extra, numbers, parse_setting, sampling, with_options,
)
from splitllm.decoding.modes import DECODERS

app = typer.Typer(no_args_is_help=True, help="Benchmarks over the real client, server and WAN proxy.")


Cores = Annotated[str, typer.Option(help=(
    "halves: each side pinned to half the cores (two machines of half this size); alternate: both sides on "
    "every core, computing in turn (two machines of this size)"))]
Models = Annotated[str, typer.Option(help="comma-separated models")]


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
    """NAME.json and NAME.md into `out`; with `doc`, also published under docs/results/ and into docs/DOC's block."""
    import json

    from splitllm.lab import results

    for folder in (Path(out), results.RESULTS) if doc else (Path(out),):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
        (folder / f"{name}.md").write_text(table)
    if doc:
        results.update_doc(results.CHECKOUT / "docs" / doc, name, table)
    typer.echo(table)


@app.command("runtime")
def runtime(
    out: Annotated[str, typer.Option(help="folder for runtime.json and runtime.md")] = "results",
    head: Head = 2,
    tail: Tail = 2,
    prompts_per_category: Annotated[int, typer.Option(help="workload prompts per category for decoding (1-8)")] = 1,
    dtype_prompts_per_category: Annotated[int, typer.Option(help="workload prompts per category for the wire dtype check")] = 2,
    max_new_tokens: int = 64,
    rtt_ms: Annotated[str, typer.Option(help="comma-separated emulated RTTs, ms")] = "0,80",
    wire_dtype: Annotated[WireDtypeName, typer.Option(help="wire dtype of the decoding runs")] = "float16",
    settings: Annotated[Optional[str], typer.Option(help="comma-separated dtype-quant settings (default: all measured)")] = None,
    fastest: Annotated[Optional[str], typer.Option(help="the setting decoded end to end next to float32-none (default: the fastest here)")] = None,
    threads: Annotated[str, typer.Option(help="comma-separated thread counts of the server forward")] = "1,2",
    model: Annotated[Optional[str], typer.Option(help="another model: its speed in-process and split, per precision, "
                                                 "beside llama.cpp on the same GGUF (see `make peers`)")] = None,
) -> None:
    """Server forward per precision vs the memory-bandwidth floor, client step, loads, RSS, decoding, wire dtypes.

    With --model: that model in-process and split per precision, the server's step in its own process, and
    llama.cpp (whole model, and its RPC backend behind the same emulated link) on the same GGUF."""
    if model:
        from splitllm.lab.bench.speed_model import MODEL_SETTINGS, run_model_runtime

        path = Path(out, "runtime-model.json")
        rtts = numbers(rtt_ms, float)
        result = run_model_runtime(
            model, path, head, tail, tuple(settings.split(",")) if settings else MODEL_SETTINGS,
            max(numbers(threads, int)), max_new_tokens, rtts[-1], prompts_per_category, wire_dtype, _progress,
        )
        typer.echo(path.with_suffix(".md").read_text())
        typer.echo(f"wrote {path}", err=True)
        return
    from splitllm.lab.bench.speed import SETTINGS, markdown, run_runtime

    path = Path(out, "runtime.json")
    result = run_runtime(
        str(path), head, tail, prompts_per_category, max_new_tokens, numbers(rtt_ms, float), wire_dtype,
        dtype_prompts_per_category, tuple(settings.split(",")) if settings else SETTINGS, fastest, numbers(threads, int),
    )
    typer.echo(markdown(result))
    typer.echo(f"wrote {path}", err=True)


@app.command("quality")
def quality(
    out: Annotated[str, typer.Option(help="folder for quality.json and quality.md")] = "results",
    prompts_per_category: Annotated[int, typer.Option(help="workload prompts per category (8: the 32-prompt suite)")] = 8,
    max_new_tokens: int = 128,
    settings: Annotated[str, typer.Option(help="comma-separated dtype-quant settings to compare with float32-none")] = (
        "bfloat16-none,bfloat16-int8,bfloat16-int4"
    ),
    ppl_positions: Annotated[int, typer.Option(help="held-out text positions for perplexity")] = 3072,
) -> None:
    """Greedy agreement with float32 and perplexity on held-out text, per precision."""
    from splitllm.lab.bench.quality import markdown, run_quality

    typer.echo(markdown(run_quality(tuple(settings.split(",")), prompts_per_category, max_new_tokens, ppl_positions, out)))


@app.command("streaming")
def streaming(
    max_new_tokens: Annotated[int, typer.Option(help="length of the answer streamed")] = 2000,
    window: Annotated[int, typer.Option(help="steps compared at each end")] = 100,
    out: Annotated[str, typer.Option(help="folder for streaming.json and streaming.md")] = "results",
) -> None:
    """The client's per-step bookkeeping (stop strings, detokenizing) at the first and last tokens of a long answer."""
    from splitllm.lab.bench.streaming import run_streaming

    typer.echo(run_streaming(out, max_new_tokens, window)["markdown"])


@app.command("sweep")
def sweep(
    out: Annotated[str, typer.Option(help="folder for steps.json, sweep.json, sweep.md and the plots")] = "results/sweep",
    links: Annotated[str, typer.Option(help="comma-separated links: RTT ms, or RTT@Mbit/s for a bandwidth cap")] = "0,20,40,80,120,200,80@20",
    prompts_per_category: Annotated[int, typer.Option(help="workload prompts per category")] = 1,
    max_new_tokens: int = 64,
    profile: Annotated[Optional[str], typer.Option(help="auto profile to use instead of calibrating one")] = None,
    merge: Annotated[bool, typer.Option(help="keep OUT/steps.json's runs at links not measured now")] = False,
    reanalyze: Annotated[bool, typer.Option(help="measure nothing: rebuild the report from OUT/steps.json")] = False,
    max_other_cores: Annotated[float, typer.Option(help="wait for, and redo generations until, others use fewer cores (0: never)")] = 0.3,
    quiet_deadline_s: Annotated[float, typer.Option(help="seconds to wait for quiet moments; then what is left runs regardless")] = 3600.0,
    setting: Setting = None,
) -> None:
    """Tokens per second against RTT for every mode: measured, predicted (cross-validated), plotted."""
    from splitllm.lab.bench.sweep import Quiet
    from splitllm.lab.bench.sweep_report import sweep as run_sweep

    need_extra("bench")
    quiet = Quiet(max_other_cores, quiet_deadline_s)
    summary = run_sweep(out, links, prompts_per_category, max_new_tokens, profile, merge, reanalyze, _command(), quiet,
                        parse_setting(setting))
    typer.echo(summary["markdown"])
    typer.echo(f"overall MAPE {100 * summary['mape']['overall']:.2f}%; plots: {', '.join(summary['plots'])}", err=True)


def speculation(
    sampling: Any,
    prompts_per_category: Annotated[int, typer.Option(help="workload prompts per category (1-8)")] = 3,
    max_new_tokens: int = 200,
    rtt_ms: RttMs = 80.0,
    decode: Annotated[
        str, typer.Option(help="comma-separated decoding modes (sequential always runs; auto-static: auto's static budget; "
                          "draft-wide: draft with 64-node trees, 8 beams of 8; auto-wide: auto choosing from 8 x 8 candidates; "
                          "auto-serial: auto drafting only between steps, none while one is in flight)")
    ] = "sequential,lookup,lookahead,draft,auto,auto-static",
    out: Annotated[str, typer.Option(help="folder for speculation.json and speculation.md")] = "results",
    wire_dtype: Annotated[WireDtypeName, typer.Option(help="float32 makes every mode's output sequential's, bit for bit")] = "float32",
    drafter: Annotated[Optional[str], typer.Option(help="drafter folder (default: the shipped one)")] = None,
    draft_model: Annotated[Optional[str], typer.Option(help="a smaller model with the same tokenizer that drafts instead (default: the model's packaged one; none: none)")] = None,
    setting: Setting = None,
    model: Model = "default",
    cores: Cores = "halves",
    publish: Annotated[bool, typer.Option(help="also write docs/results/speculation.json (the summary) and regenerate docs/drafting.md's table")] = False,
) -> None:
    """Tokens per round trip and speedup of each decoding mode through a server behind the WAN proxy."""
    from splitllm.lab.bench.speculation import EXTRA_DECODERS, report, run_speculation

    modes = tuple(m.strip() for m in decode.split(",") if m.strip())
    unknown = [m for m in modes if m not in DECODERS and m not in EXTRA_DECODERS]
    if unknown:
        raise typer.BadParameter(f"unknown modes {', '.join(unknown)}; choose from {', '.join([*DECODERS, *EXTRA_DECODERS])}")
    _core_layout(cores)
    result = run_speculation(
        prompts_per_category, max_new_tokens, rtt_ms, modes, out, progress=_progress, sampling=sampling,
        wire_dtype=wire_dtype, drafter=drafter, precision=parse_setting(setting), model=model, core_layout=cores,
        draft_model=draft_model,
    )
    if publish:
        _write({"provenance": _provenance(), **result}, "speculation", report(result), out, "drafting.md")
    else:
        typer.echo(report(result))


app.command("speculation")(with_options(sampling=sampling)(speculation))


@app.command("confidential")
def confidential(
    model: Models = "default,qwen2.5-coder-1.5b",
    rtt_ms: Annotated[str, typer.Option(help="comma-separated emulated RTTs, ms")] = "0,80",
    prompts_per_category: Annotated[int, typer.Option(help="workload prompts per category (1-8)")] = 1,
    max_new_tokens: int = 64,
    decode: Annotated[str, typer.Option(help="comma-separated decoding modes, each measured plain and sealed")] = "auto,sequential",
    cores: Cores = "halves",
    out: Annotated[str, typer.Option(help="folder for confidential.json and confidential.md")] = "results",
    publish: Annotated[bool, typer.Option(help="also write docs/results/confidential.json and regenerate docs/confidential.md's table")] = False,
) -> None:
    """What an attested, sealed session costs against the same split in the clear: tok/s, handshake, sealing."""
    from splitllm.lab.bench.confidential import markdown, run_confidential

    modes = tuple(m.strip() for m in decode.split(",") if m.strip())
    if not modes or any(m not in DECODERS for m in modes):
        raise typer.BadParameter(f"--decode takes modes among {', '.join(DECODERS)}")
    result = {"provenance": _provenance()}
    result |= run_confidential(
        _models(model), numbers(rtt_ms, float), prompts_per_category, max_new_tokens, modes, _core_layout(cores), _progress
    )
    _write(result, "confidential", markdown(result), out, "confidential.md" if publish else None)


@app.command("conversation")
def conversation(
    model: Models = "default,qwen2.5-coder-1.5b",
    rtt_ms: RttMs = 80.0,
    first_turn_tokens: Annotated[int, typer.Option(help="about this many tokens in the first turn (a pasted document)")] = 1500,
    chats: Annotated[int, typer.Option(help="chats measured per model (after one that warms up)")] = 2,
    cores: Cores = "halves",
    out: Annotated[str, typer.Option(help="folder for conversation.json and conversation.md")] = "results",
    publish: Annotated[bool, typer.Option(help="also write docs/results/conversation.json and regenerate docs/usage.md's table")] = False,
) -> None:
    """A chat's follow-up turn through client-api: time to first token, continuing the conversation against fresh."""
    from splitllm.lab.bench.conversation import markdown, run_conversation

    result = {"provenance": _provenance()}
    result |= run_conversation(_models(model), rtt_ms, first_turn_tokens, chats, _core_layout(cores), _progress)
    _write(result, "conversation", markdown(result), out, "usage.md" if publish else None)


@app.command("structured")
def structured(
    model: Models = "default,gemma3,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b",
    rtt_ms: RttMs = 80.0,
    max_tokens: Annotated[int, typer.Option(help="the most tokens of each JSON answer")] = 128,
    cores: Cores = "halves",
    out: Annotated[str, typer.Option(help="folder for structured.json and structured.md")] = "results",
    publish: Annotated[bool, typer.Option(help="also write docs/results/structured.json and regenerate docs/usage.md's table")] = False,
) -> None:
    """JSON schemas and tool calls through client-api (validity, auto against sequential) and the grammar's mask cost."""
    from splitllm.lab.bench.structured import markdown, run_structured

    result = {"provenance": _provenance()}
    result |= run_structured(_models(model), rtt_ms, max_tokens, _core_layout(cores), _progress)
    _write(result, "structured", markdown(result), out, "usage.md" if publish else None)


@app.command("exactness")
def exactness(
    prompts_per_category: Annotated[int, typer.Option(help="workload prompts per category (1-8)")] = 8,
    max_new_tokens: int = 128,
    out: Annotated[str, typer.Option(help="folder for exactness.json and exactness.md")] = "results",
    model: Model = "default",
    setting: Setting = None,
) -> None:
    """Every speculative mode against sequential greedy on the real model; divergences with their logit gaps."""
    from splitllm.lab.bench.exactness import NEAR_TIE, run_exactness

    report = run_exactness(prompts_per_category, max_new_tokens, out, model, parse_setting(setting))
    typer.echo(report.markdown())
    if not report.explained:
        fail(f"a divergence at a top-2 logit gap >= {NEAR_TIE} is not a rounding effect", code=1)


@app.command("defaults")
def defaults(
    out: Annotated[str, typer.Option(help="folder for defaults.json and defaults.md")] = "results",
    prompts_per_category: Annotated[int, typer.Option(help="workload prompts per category (1-8)")] = 1,
    max_new_tokens: int = 64,
    rtt_ms: RttMs = 0.0,
) -> None:
    """`serve` + `generate` with no precision or thread options against the fastest setting and threads named."""
    from splitllm.lab.bench.defaults import run_defaults

    typer.echo(run_defaults(out, prompts_per_category, max_new_tokens, rtt_ms, _progress)["markdown"])


@app.command("load")
def load(
    clients: Annotated[str, typer.Option(help="comma-separated concurrent client counts (threads sharing one client model)")] = "1,4,16,64",
    batch_window_ms: Annotated[str, typer.Option(help="comma-separated batching windows, one server each; 0: off")] = "0,2",
    ray_replicas: Annotated[str, typer.Option(help="comma-separated Ray Serve replica counts, one deployment each (batching on); empty: none")] = "1,2",
    max_new_tokens: int = 32,
    rtt_ms: RttMs = 80.0,
    prompts: Annotated[int, typer.Option(help="distinct workload prompts, cycled over the clients")] = 8,
    max_context: Annotated[int, typer.Option(help="longest session, in tokens")] = 256,
    max_kv_gib: Annotated[float, typer.Option(help="the server's KV memory bound, GiB")] = 1.0,
    clients_compute: Annotated[
        str, typer.Option(help="device: clients replay solo runs, their compute a pause (own devices); real: all compute here")
    ] = "device",
    out: Annotated[str, typer.Option(help="folder for load.json, load.md and load.png")] = "results/load",
    prefill: Annotated[
        int, typer.Option(help="instead: the largest --clients decoders alone, then with one prompt of this many positions")
    ] = 0,
    max_nodes_per_step: Annotated[int, typer.Option(help="the server's positions per step (--prefill runs)")] = 256,
    max_batch_rows: Annotated[int, typer.Option(help="the server's positions per shared forward (--prefill runs)")] = 256,
    slice_rows: Annotated[int, typer.Option(help="the server's slice of a long step (--prefill runs)")] = 16,
) -> None:
    """Concurrent clients through the WAN proxy: correctness, step latency p50/p99, tokens/s, KV bound."""
    from splitllm.lab.bench.load import LoadSettings, ServerKind, run_load, run_prefill
    from splitllm.lab.bench.load_report import prefill_markdown

    need_extra("bench")
    counts, windows, replicas = numbers(clients, int), numbers(batch_window_ms, float), numbers(ray_replicas, int)
    if clients_compute not in ("device", "real"):
        raise typer.BadParameter("--clients-compute is device or real")
    if not counts or min(counts) < 1 or any(r < 1 for r in replicas) or any(w < 0 for w in windows):
        raise typer.BadParameter("client and replica counts are at least 1, windows at least 0")
    if replicas:
        need_extra("ray")
    on = max(windows, default=2.0) or 2.0
    settings = LoadSettings(
        max_new_tokens=max_new_tokens, rtt_ms=rtt_ms, prompts=prompts, context=max_context, max_kv_gib=max_kv_gib,
        clients_compute="device" if prefill > 0 else clients_compute,
    )
    if prefill > 0:
        serve_args = [
            "--max-nodes-per-step", str(max_nodes_per_step), "--max-batch-rows", str(max_batch_rows),
            "--slice-rows", str(slice_rows),
        ]
        result = run_prefill(max(counts), prefill, settings, on, serve_args, out, _command(), progress=_progress)
        typer.echo(prefill_markdown(result))
        typer.echo(f"wrote {out}/prefill.json, prefill.md", err=True)
        rows = (result["alone"], result["with_prefill"])
        if not result["prefill_ok"] or any(r["errors"] or r["correct_clients"] != r["clients"] for r in rows):
            raise typer.Exit(1)
        return
    kinds = [ServerKind(w) for w in windows] + [ServerKind(on, r) for r in replicas]
    result = run_load(counts, kinds, settings, out, _command(), progress=_progress)
    typer.echo(Path(out, "load.md").read_text())
    typer.echo(f"wrote {out}/load.json, load.md, load.png", err=True)
    failed = [r for r in result["rows"] if r["errors"] or r["correct_clients"] != r["clients"]]
    if failed or not result["kv_within_bound"]:
        raise typer.Exit(1)
