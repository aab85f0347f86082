"""`splitllm bench streaming`: does the client's per-step bookkeeping stay flat over a long answer?

A real generation of `tokens` tokens (EOS ignored, so it runs to the end) through the in-process
middle, with a stop string that never matches: the worst case for stop-string search. Each step's
`other_ms` is the client's bookkeeping (stop rules and detokenizing, outside the model); the first
and last `window` steps are compared. For scale, re-decoding the whole answer at every step (what a
non-incremental stream does) is timed on the same ids.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from splitllm.client.client import SplitClient
from splitllm.threads import set_compute_threads

PROMPT = "Write a long story about a lighthouse keeper, chapter by chapter."
NEVER = "</never-in-the-answer>"


def _ms(values: list[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(values), "mean_ms": statistics.fmean(values)}


def run_streaming(out: str, tokens: int = 2000, window: int = 100, decode: str = "sequential") -> dict:
    """Measure, write `out`/streaming.json and streaming.md, return the result."""
    set_compute_threads(1)
    client = SplitClient(None, None, first=2, last=2, max_context=tokens + 256)
    client.stop_ids = frozenset()  # run to the token budget
    gen = client.generate(PROMPT, tokens, decode, stop=[NEVER])
    other = [s.timing.other_ms for s in gen.steps[1:]]  # the prefill's step is not a streaming step
    redecode = []
    for n in (*range(1, window + 1), *range(len(gen.ids) - window + 1, len(gen.ids) + 1)):
        t0 = time.perf_counter()
        client.tokenizer.decode(gen.ids[:n], skip_special_tokens=True)
        redecode.append((time.perf_counter() - t0) * 1000)
    whole = client.tokenizer.decode(gen.ids, skip_special_tokens=True)
    result = {
        "tokens": len(gen.ids),
        "steps": len(gen.steps),
        "decode": decode,
        "window": window,
        "incremental": {"first": _ms(other[:window]), "last": _ms(other[-window:])},
        "full_redecode": {"first": _ms(redecode[:window]), "last": _ms(redecode[window:])},
        "text_equals_full_decode": gen.text == whole,
    }
    inc, full = result["incremental"], result["full_redecode"]
    result["markdown"] = "\n".join(
        [
            f"Client bookkeeping per step over a {result['tokens']}-token answer ({decode}, stop string searched "
            f"every step), median of the first and last {window} steps:",
            "",
            "| per step | first steps | last steps | last / first |",
            "| --- | --- | --- | --- |",
            *(
                f"| {name} | {r['first']['median_ms']:.3f} ms | {r['last']['median_ms']:.3f} ms | "
                f"{r['last']['median_ms'] / max(r['first']['median_ms'], 1e-9):.2f}x |"
                for name, r in (("incremental (splitllm)", inc), ("re-decoding the whole answer", full))
            ),
            "",
            f"Streamed text equals decoding the whole answer once: {result['text_equals_full_decode']}.",
        ]
    )
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, "streaming.json").write_text(json.dumps(result, indent=2))
    Path(out, "streaming.md").write_text(result["markdown"] + "\n")
    return result
