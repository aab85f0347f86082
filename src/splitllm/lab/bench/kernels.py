"""`splitllm bench kernels`: the whole model in one process on one core, per CPU kernel variant and setting,
beside llama.cpp on one thread on the same GGUF and core, in one run.

It answers two questions per machine: which setting is fastest on each kernel variant (the rule
`model.precision.fastest` applies: bfloat16-mixed wherever a variant runs), and how each variant
compares with llama.cpp built for the same instructions (`native`, or on a CPU wider than AVX2 the `avx2`
build, x86-64-v3 alone, as the AVX2 kernels' peer: `peers.matching`). Every figure decodes sequentially in
a fresh process (a process loads one variant, `SPLITLLM_KERNELS`) pinned to the same core with one
compute thread; the prompts' first step and the load are left out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from splitllm.kernels import cpu_kernels
from splitllm.lab import peers
from splitllm.lab.data.workload import workload
from splitllm.testing.launch import pinned
from splitllm.weights.packaged import PACKAGED_MODELS
from splitllm.weights.sources import packaged_gguf_path

Progress = Callable[[str], None]
SETTINGS = ("bfloat16-mixed", "bfloat16-int8", "bfloat16-int4", "bfloat16-none", "float32-none")
DEFAULT = "bfloat16-mixed"  # what `model.precision.fastest` picks wherever a variant runs


@dataclass(frozen=True)
class KernelsBench:
    models: tuple[str, ...]
    variants: tuple[str, ...]  # empty: every variant this CPU runs
    settings: tuple[str, ...]
    prompts: int
    tokens: int


def _worker(model: str, setting: str, prompts: Sequence[str], tokens: int) -> dict[str, Any]:
    """In this process: the model in-process on one thread, sequential decoding's speed (no draft model)."""
    from splitllm.client.client import SplitClient
    from splitllm.lab.bench.speed_model import decode_speed
    from splitllm.model.precision import Precision
    from splitllm.threads import set_compute_threads

    set_compute_threads(1)
    client = SplitClient(model, None, precision=Precision.from_name(setting), draft_model="none")
    speed = decode_speed(client, prompts, tokens)
    return {"tokens_per_second": speed["tok_s"], "tokens": speed["tokens"], "linear_kernels": cpu_kernels.linear_path()}


def _measure(model: str, variant: str, setting: str, bench: KernelsBench, core: int) -> dict[str, Any]:
    prompts = [item.text for item in workload(1)][: bench.prompts]
    args = json.dumps({"model": model, "setting": setting, "prompts": prompts, "tokens": bench.tokens})
    done = subprocess.run(
        [sys.executable, "-m", "splitllm.lab.bench.kernels", args], capture_output=True, text=True, timeout=3600,
        env={**os.environ, cpu_kernels.SWITCH: variant, "OMP_NUM_THREADS": "1"}, preexec_fn=pinned({core}),
    )
    if done.returncode:
        raise RuntimeError(f"{model} {setting} on {variant} failed: {done.stderr.strip()[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_kernels(bench: KernelsBench, progress: Progress) -> dict[str, Any]:
    """Every model x variant x setting, then llama.cpp's builds, each on the same one core."""
    runnable = [v.name for v in cpu_kernels.runnable()]
    variants = bench.variants or tuple(runnable)
    for name in variants:
        if name not in runnable:
            raise ValueError(
                f"kernel variant {name!r} does not run on this CPU (it runs {', '.join(runnable) or 'none'})"
            )
    core = max(os.sched_getaffinity(0))
    builds = {variant: peers.matching(variant) for variant in variants}
    models: dict[str, Any] = {}
    for model in bench.models:
        splitllm: dict[str, dict[str, Any]] = {}
        for variant in variants:
            for setting in bench.settings:
                figure = _measure(model, variant, setting, bench, core)
                splitllm.setdefault(variant, {})[setting] = figure
                progress(f"{model} {variant} {setting}: {figure['tokens_per_second']:.2f} tok/s")
        llama: dict[str, Any] = {}
        for isa in sorted(set(builds.values())):
            if model not in PACKAGED_MODELS:
                llama[isa] = {"skipped": "llama.cpp needs the model's GGUF: only packaged models have one here"}
            elif peers.find(isa) is None:
                llama[isa] = {"skipped": peers._no_build(isa)}
            else:
                llama[isa] = peers.whole_model(packaged_gguf_path(model), 1, bench.tokens, {core}, isa).as_dict()
                progress(f"{model} llama.cpp {isa}: {llama[isa]['tokens_per_second']:.2f} tok/s")
        models[model] = {"splitllm": splitllm, "llama_cpp": llama,
                         "against_llama_cpp": _ratios(splitllm, llama, builds)}
    return {"settings": {"models": list(bench.models), "variants": list(variants), "settings": list(bench.settings),
                         "prompts": bench.prompts, "max_new_tokens": bench.tokens, "threads": 1,
                         "llama_cpp_builds": builds},
            "models": models}


def _ratios(
    splitllm: dict[str, dict[str, Any]], llama: dict[str, Any], builds: dict[str, str]
) -> dict[str, dict[str, Any]]:
    """Per variant: its fastest setting, and that setting's and the default's speed over its llama.cpp build's."""
    out = {}
    for variant, figures in splitllm.items():
        fastest = max(figures, key=lambda s: figures[s]["tokens_per_second"])
        peer = llama.get(builds[variant], {}).get("tokens_per_second")
        default = figures.get(DEFAULT, {}).get("tokens_per_second")
        out[variant] = {"fastest_setting": fastest,
                        "default": None if not (peer and default) else default / peer,
                        "fastest": None if not peer else figures[fastest]["tokens_per_second"] / peer}
    return out


def markdown(result: dict[str, Any]) -> str:
    """One table per model: tok/s per variant and setting, llama.cpp's builds, and the ratios."""
    settings, builds = result["settings"]["settings"], result["settings"]["llama_cpp_builds"]
    lines = []
    for model, figures in result["models"].items():
        lines += [f"**{model}**, one core, one thread, tok/s "
                  f"(sequential, {result['settings']['max_new_tokens']} tokens):", "",
                  "| kernels | " + " | ".join(settings) + " | llama.cpp (same instructions) | default / llama.cpp |",
                  "| --- |" + " --- |" * (len(settings) + 2)]
        for variant, row in figures["splitllm"].items():
            peer = figures["llama_cpp"].get(builds[variant], {})
            ratio = figures["against_llama_cpp"][variant]["default"]
            cells = [f"{row[s]['tokens_per_second']:.2f}" for s in settings]
            peer_cell = (
                f"{peer['tokens_per_second']:.2f} ({builds[variant]})"
                if "tokens_per_second" in peer
                else "not built"
            )
            lines.append(
                f"| {variant} | "
                + " | ".join(cells)
                + f" | {peer_cell} | {'-' if ratio is None else f'{ratio:.2f}x'} |"
            )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    print(json.dumps(_worker(job["model"], job["setting"], job["prompts"], job["tokens"])))
