"""`splitllm bench speed`'s report: the targets each figure is held to, and the Markdown tables."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from splitllm.lab.bench.speed_compute import MIB

GEMMA_VOCAB = 262_144
TARGETS = {
    "server_1_token_ms_bfloat16-none": 15.0,
    "server_1_token_ms_bfloat16-int8": 9.0,
    "server_1_token_floor_ratio": 1.3,
    "client_1_token_ms": 6.0,
    "sequential_tok_s_at_0ms": 40.0,
    "sequential_tok_s_at_80ms": 9.5,
    "speedup_over_float32_at_0ms": 1.6,
}


def met(result: dict[str, Any]) -> dict[str, bool | None]:
    """Each target against the best figure measured for it (None: not measured in this run)."""
    fwd, fastest = result["server_forward"], result["fastest"]

    def best(prefix: str, key: Callable[[dict[str, Any]], float]) -> float | None:
        values = [key(v) for k, v in fwd.items() if k.startswith(prefix + " ")]
        return min(values) if values else None

    seq = result["decoding"].get(fastest, {}).get("sequential", {})
    exact = result["decoding"].get("float32-none", {}).get("sequential", {})
    figures = {
        "server_1_token_ms_bfloat16-none": best("bfloat16-none", lambda v: v["tokens"]["1"]["median_ms"]),
        "server_1_token_ms_bfloat16-int8": best("bfloat16-int8", lambda v: v["tokens"]["1"]["median_ms"]),
        "client_1_token_ms": min((v["median_ms"] for v in result["client_step"].values()), default=None),
        "sequential_tok_s_at_0ms": seq.get("0", {}).get("tok_s"),
        "sequential_tok_s_at_80ms": seq.get("80", {}).get("tok_s"),
    }
    ratios = [min(v["tokens"]["1"]["floor_ratio"] for k, v in fwd.items() if k.startswith(s + " "))
              for s in result["settings"]]
    if "0" in seq and "0" in exact:
        figures["speedup_over_float32_at_0ms"] = seq["0"]["tok_s"] / exact["0"]["tok_s"]
    out: dict[str, bool | None] = {}
    for name, target in result["targets"].items():
        if name == "server_1_token_floor_ratio":
            out[name] = bool(ratios) and max(ratios) <= target
        elif figures.get(name) is None:
            out[name] = None
        elif name.startswith(("sequential", "speedup")):
            out[name] = figures[name] >= target
        else:
            out[name] = figures[name] <= target
    return out


def _or_dash(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(result: dict[str, Any]) -> str:
    """The report as Markdown tables (what `bench speed` prints and writes next to the JSON)."""
    split = result["split"]
    sections = (_bandwidth, _server_forward, _client_step, _loading, _decoding, _wire_dtypes, _targets)
    lines = [f"# Runtime, default model split {split[0]}+{split[1]}"]
    for section in sections:
        lines += section(result)
    return "\n".join(lines) + "\n"


def _bandwidth(result: dict[str, Any]) -> list[str]:
    lines = ["", "## Memory read bandwidth", "", "| threads | read GB/s | copy GB/s (read + write) |",
             "| --- | --- | --- |"]
    return lines + [f"| {n} | {bw['read_gb_s']:.2f} | {bw['copy_gb_s']:.2f} |" for n, bw in result["bandwidth"].items()]


def _server_forward(result: dict[str, Any]) -> list[str]:
    some = next(iter(result["server_forward"].values()))
    start, end = some["layers"]
    lines = ["", f"## Server forward, layers [{start}, {end}), context {some['context']}", "",
             "Floor: the stage's weight bytes read once at the read bandwidth of the same thread count; "
             "with cache: plus the keys and values a one-position step attends to. Layer by layer: the same "
             "step without the kernel stage (where the setting runs one).", "",
             "| setting | threads | weights MiB | floor ms | 1 position ms (x floor) | floor with cache ms (x) | "
             "layer by layer ms | 8 positions ms | 32 positions ms | others' cores |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key, fwd in result["server_forward"].items():
        setting, threads = key.split()
        t = fwd["tokens"]
        lines.append(
            f"| {setting} | {threads.removesuffix('t')} | {fwd['weight_bytes'] / MIB:.0f} | {fwd['floor_ms']:.1f} | "
            f"{t['1']['median_ms']:.1f} ({t['1']['floor_ratio']:.2f}x) | "
            f"{_or_dash(fwd.get('cache_floor_ms'), '.1f')} ({_or_dash(t['1'].get('cache_floor_ratio'), '.2f')}x) | "
            f"{_or_dash(t['1'].get('layered_ms'), '.1f')} | {t['8']['median_ms']:.1f} | "
            f"{t['32']['median_ms']:.1f} | {max(r['others_cores'] for r in t.values()):.2f} |"
        )
    return lines


def _client_step(result: dict[str, Any]) -> list[str]:
    lines = ["", "## Client compute for one token (embedding, first and last stages, LM head)", "",
             "| setting | threads | weights MiB | median ms | others' cores |", "| --- | --- | --- | --- | --- |"]
    for key, c in result["client_step"].items():
        setting, threads = key.split()
        lines.append(f"| {setting} | {threads.removesuffix('t')} | {c['weight_bytes'] / MIB:.0f} | "
                     f"{c['median_ms']:.2f} | {c['others_cores']:.2f} |")
    gemma = result.get("client_step_gemma3")
    if gemma:
        lines += ["", f"## Gemma 3 270M: client compute for one token (one thread; LM head of {GEMMA_VOCAB:,} rows)",
                  "", "| setting | weights MiB | LM head MiB | median ms | others' cores |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {setting} | {c['weight_bytes'] / MIB:.0f} | {c['lm_head_bytes'] / MIB:.0f} "
                  f"| {c['median_ms']:.2f} | {c['others_cores']:.2f} |" for setting, c in gemma.items()]
    return lines


def _loading(result: dict[str, Any]) -> list[str]:
    lines = ["", "## Load time and peak memory", "", "| load | total s | resolve s | server s | client s |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {k} | {v['total_s']:.2f} | {v['resolve_s']:.2f} | {v['server_s']:.2f} | {v['client_s']:.2f} |"
              for k, v in result["load"].items()]
    lines += ["", "| process | peak RSS MiB | above imports MiB | weights MiB |", "| --- | --- | --- | --- |"]
    return lines + [f"| {k} | {m['peak_mib']:.0f} | {m['peak_mib'] - m['baseline_mib']:.0f} | {m['weights_mib']:.0f} |"
                    for k, m in result["memory"].items()]


def _decoding(result: dict[str, Any]) -> list[str]:
    lines = ["", f"## Decoding through `splitllm serve` ({result['decoding_wire_dtype']} wire, one thread per side)",
             "", "| setting | decoding | RTT ms | tok/s | tokens/step | step ms | first stage | server | network "
             "| last stage | others' cores |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for setting, runs in result["decoding"].items():
        for decode, by_rtt in runs.items():
            for run in by_rtt.values():
                m = run["mean_step_ms"]
                lines.append(
                    f"| {setting} | {decode} | {run['rtt_ms']:g} | {run['tok_s']:.2f} | {run['tokens_per_step']:.2f} | "
                    f"{m['total_ms']:.1f} | {m['first_ms']:.1f} | {m['server_ms']:.1f} | {m['network_ms']:.1f} | "
                    f"{m['last_ms']:.1f} | {run['others_cores']:.2f} |"
                )
    return lines


def _wire_dtypes(result: dict[str, Any]) -> list[str]:
    wd = result.get("wire_dtypes")
    if not wd:
        return []
    return ["", "## Wire dtypes (float32 compute)", ""] + [
        f"- {d} wire: {wd[d]['identical']}/{wd['prompts']} generations of {wd['new_tokens']} tokens identical "
        f"to a float32 wire (first differences: {wd[d]['first_difference']})" for d in ("float16", "bfloat16")
    ]


def _targets(result: dict[str, Any]) -> list[str]:
    verdict = {True: "met", False: "MISSED", None: "not measured"}
    return ["", "## Targets", "", "| target | value | met |", "| --- | --- | --- |"] + [
        f"| {k} | {v:g} | {verdict[result['met'][k]]} |" for k, v in result["targets"].items()
    ]
