"""`splitllm bench quality`: what each precision costs in answers, against the float32 exact mode.

For every setting (the same precision on client and server, in-process): greedy continuations of the
shared workload compared with float32's (identical ones, and the mean position of the first
divergence among the others), and perplexity on held-out text windows next to float32's.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from splitllm.lab.bench.exactness import first_difference
from splitllm.lab.data.workload import workload
from splitllm.client.pipeline import InProcessMiddle
from splitllm.client.client import SplitClient
from splitllm.model.precision import Precision
from splitllm.model.stage import Stage
from splitllm.lab.data.corpus import build_corpus
from splitllm.lab.heldout import log_probs, quality
from splitllm.threads import set_compute_threads

Progress = Callable[[str], None]


def run_quality(
    settings: Sequence[str] = ("bfloat16-none", "bfloat16-int8", "bfloat16-int4"),
    per_category: int = 8,
    max_new_tokens: int = 128,
    ppl_positions: int = 3072,
    out: str | Path = "results",
    progress: Progress = lambda line: print(line, file=sys.stderr, flush=True),
) -> dict[str, Any]:
    set_compute_threads(1)
    prompts = [p.text for p in workload(per_category)]
    result: dict[str, Any] = {
        "prompts": len(prompts), "max_new_tokens": max_new_tokens, "split": [2, 2], "settings": {},
    }
    reference: list[list[int]] = []
    reference_lp: torch.Tensor | None = None
    for name in ("float32-none", *settings):
        precision = Precision.from_name(name)
        client = SplitClient(None, None, 2, 2, precision=precision)
        ids = [client.generate(client.encode_prompt(p), max_new_tokens, "sequential").ids for p in prompts]
        middle = Stage.load(client.files, *client.client_model.middle_range, precision)
        windows = build_corpus(client.tokenizer, test_positions=ppl_positions, train_positions=0).test
        lp = log_probs(client.client_model, lambda middle=middle,
                       windows=windows: InProcessMiddle(middle, windows.shape[1]), windows)
        reference_lp = lp if reference_lp is None else reference_lp
        cost = quality(windows, reference_lp, lp)
        ppl = cost["perplexity"]
        row: dict[str, Any] = {
            "perplexity": ppl, "kl_nats": cost["kl_nats"], "top1_agreement": cost["top1_agreement"],
            "ppl_positions": int(windows.numel()),
        }
        if reference:
            first = [first_difference(ref, got) for ref, got in zip(reference, ids)]
            diverged = [f for f in first if f is not None]
            row |= {
                "identical": len(first) - len(diverged),
                "mean_first_divergence": statistics.fmean(diverged) if diverged else None,
                "first_divergence": first,
            }
        else:
            reference = ids
        result["settings"][name] = row
        progress(
            f"  {name}: perplexity {ppl:.3f}"
            + (f", {row['identical']}/{len(prompts)} identical" if "identical" in row else "")
        )
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "quality.json").write_text(json.dumps(result, indent=1))
    (folder / "quality.md").write_text(markdown(result))
    return result


def markdown(result: dict[str, Any]) -> str:
    base = result["settings"]["float32-none"]["perplexity"]
    lines = [
        f"Quality against float32, default model split 2+2, {result['prompts']} prompts x "
        f"{result['max_new_tokens']} greedy tokens; perplexity on held-out text.",
        "",
        "| setting | identical to float32 | mean first divergence (token) | perplexity | vs float32 "
        "| KL from float32 (nats/token) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in result["settings"].items():
        same = f"{row['identical']} / {result['prompts']}" if "identical" in row else "reference"
        mean = row.get("mean_first_divergence")
        lines.append(
            f"| {name} | {same} | {'-' if mean is None else f'{mean:.1f}'} | {row['perplexity']:.3f} | "
            f"{row['perplexity'] / base:.3f}x | {row['kl_nats']:.4f} |"
        )
    return "\n".join(lines) + "\n"
