"""`splitllm bench exactness`: does every decoding mode commit what sequential greedy commits, on the real model?

In float32 the answer can differ only where the model's top two logits nearly tie: a speculative
step scores several positions in one batch, whose kernels round differently from one position at a
time (docs/correctness.md). So each divergence is reported with the top-2 logit gap of the model at
the prefix where it happened, recomputed from scratch; a gap far above float32 rounding would be a bug.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from splitllm.lab.data.workload import workload
from splitllm.client.client_model import ClientModel
from splitllm.client.pipeline import InProcessMiddle, SplitPipeline
from splitllm.client.client import SplitClient
from splitllm.decoding.speculation_config import SPECULATIVE_MODES as MODES
from splitllm.model.precision import Precision
from splitllm.model.stage import Stage, Step
from splitllm.threads import set_compute_threads
from splitllm.model.visibility import Visibility

NEAR_TIE = 0.05  # logit gap under which float32 rounding of a batched step may flip the argmax


@dataclass
class Divergence:
    prompt: int
    mode: str
    index: int  # first new token that differs
    sequential: int
    speculative: int
    gap: float  # top-2 logit gap of the model at that prefix


@dataclass
class ExactnessReport:
    max_new_tokens: int
    modes: list[str]
    prompts: int
    identical: dict[str, int] = field(default_factory=dict)
    divergences: list[Divergence] = field(default_factory=list)
    model: str = "default"
    precision: str = "float32-none"

    @property
    def explained(self) -> bool:
        """Every divergence happened at a near-tie."""
        return all(d.gap < NEAR_TIE for d in self.divergences)

    def markdown(self) -> str:
        lines = [
            f"Exactness on the {self.model} model ({self.precision}), {self.prompts} prompts x "
            f"{self.max_new_tokens} new tokens, every mode against sequential greedy decoding.",
            "",
            "| mode | identical / total |",
            "| --- | --- |",
            *(f"| {m} | {self.identical[m]} / {self.prompts} |" for m in self.modes),
        ]
        if self.divergences:
            lines += [
                "",
                "| prompt | mode | at token | sequential | speculative | top-2 logit gap |",
                "| --- | --- | --- | --- | --- | --- |",
            ]
            lines += [
                f"| {d.prompt} | {d.mode} | {d.index} | {d.sequential} | {d.speculative} | {d.gap:.2e} |"
                for d in self.divergences
            ]
        return "\n".join(lines) + "\n"


def top2_gap(client_model: ClientModel, middle: Stage, ids: Sequence[int]) -> float:
    """The model's top-2 logit gap after `ids`, from a fresh prefill."""
    n = len(ids)
    pipeline = SplitPipeline(client_model, InProcessMiddle(middle, n), n)
    tokens, last = torch.tensor(list(ids)), torch.tensor([n - 1])
    logits, _ = pipeline.score(Step(tokens, torch.arange(n), Visibility.chain(n)), rows=last)
    top = logits[0].topk(2).values
    return float(top[0] - top[1])


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_exactness(
    client: SplitClient, prompts: Sequence[str], max_new_tokens: int, modes: Sequence[str] | None = None
) -> ExactnessReport:
    """Every mode (default: all speculative modes, `drafter` only when the model has a drafter)."""
    if modes is None:
        drafts = client.client_model.drafter is not None or client.client_model.draft_model is not None
        modes = [m for m in MODES if m != "drafter" or drafts]
    report = ExactnessReport(max_new_tokens, list(modes), len(prompts), {m: 0 for m in modes},
                             precision=client.precision.name)
    middle = Stage.load(client.files, *client.client_model.middle_range, client.precision)
    for p, prompt in enumerate(prompts):
        ids = client.encode_prompt(prompt)
        expected = client.generate(ids, max_new_tokens, "sequential").ids
        for mode in modes:
            got = client.generate(ids, max_new_tokens, decode=mode).ids
            i = first_difference(expected, got)
            if i is None:
                report.identical[mode] += 1
                continue
            seq_tok = expected[i] if i < len(expected) else -1
            spec_tok = got[i] if i < len(got) else -1
            gap = top2_gap(client.client_model, middle, ids + expected[:i])
            report.divergences.append(Divergence(p, mode, i, seq_tok, spec_tok, gap))
    return report


def run_exactness(
    per_category: int = 8,
    max_new_tokens: int = 128,
    out: str | Path = "results",
    model: str = "default",
    precision: Precision = Precision(),
) -> ExactnessReport:
    """The benchmark: the shared workload in-process (the network cannot change tokens: wire tests cover it),
    every mode against sequential decoding in the same precision (float32 by default)."""
    set_compute_threads(1)
    client = SplitClient(model, precision=precision)
    report = check_exactness(client, [p.text for p in workload(per_category)], max_new_tokens)
    report.model = model
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "exactness.json").write_text(json.dumps({**asdict(report), "explained": report.explained}, indent=1))
    (folder / "exactness.md").write_text(report.markdown())
    return report
