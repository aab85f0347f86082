"""`splitllm bench suffix`: drafting from earlier requests (`SuffixCache`) on and off, over the WAN proxy.

A coding session as an agent runs one: separate requests that share a frame (one system prompt, tasks
of one kind, answers of one shape), each a fresh conversation, then the same requests again (an agent's
retries and regenerations). Each setting runs the session on the same client and server: `auto`'s
tokens per step, tok/s and the client's CPU time per token (this process, the proxy's forwarding
included, as in `bench speculation`), and whether every answer is the cache-off answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from splitllm.client.client import SplitClient
from splitllm.decoding.proposers.suffix import SuffixCache
from splitllm.testing.launch import client_over_link

SYSTEM = ("You are a coding assistant. Answer with one Python function with type hints and a one-line docstring, "
          "then one line that calls it.")
TASKS = (
    "Write a function that returns the sum of a list of numbers.",
    "Write a function that returns the product of a list of numbers.",
    "Write a function that returns the largest number in a list.",
    "Write a function that returns the mean of a list of numbers.",
    "Write a function that counts the even numbers in a list.",
    "Write a function that returns a list of numbers sorted from largest to smallest.",
    "Write a function that returns the squares of a list of numbers.",
    "Write a function that removes the duplicates from a list of numbers.",
)
PASSES = ("first", "again")  # the session, then the same requests once more


def _session(client: SplitClient, max_new_tokens: int, run: Callable[[Callable[[], Any]], Any]) -> list[dict]:
    """Every task of both passes, each a fresh conversation: its tokens, steps, time and client CPU."""
    rows = []
    for which in PASSES:
        for task in TASKS:
            ids = client.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                        {"role": "user", "content": task}], add_generation_prompt=True)
            prompt = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            cpu = time.process_time()
            gen = run(lambda prompt=prompt: client.generate(prompt, max_new_tokens, decode="auto"))
            rows.append({"pass": which, "task": task, "ids": gen.ids, "steps": len(gen.steps) - 1,  # less the prefill
                         "seconds": gen.seconds, "client_cpu_ms": (time.process_time() - cpu) * 1000,
                         "suffix_tokens": sum(s.speculation.sources.get("suffix", 0) for s in gen.steps)})
    return rows


def _summary(rows: Sequence[dict]) -> dict:
    tokens = sum(len(r["ids"]) for r in rows)
    steps = sum(r["steps"] for r in rows)
    return {"tokens": tokens, "tokens_per_step": tokens / steps if steps else 0.0,
            "tokens_per_second": tokens / sum(r["seconds"] for r in rows),
            "client_cpu_ms_per_token": sum(r["client_cpu_ms"] for r in rows) / tokens if tokens else 0.0,
            "suffix_share": sum(r["suffix_tokens"] for r in rows) / tokens if tokens else 0.0}


def measure_model(model: str, rtt_ms: float, max_new_tokens: int, core_layout: str,
                  progress: Callable[[str], None]) -> dict:
    runs: dict[str, list[dict]] = {}
    with client_over_link(model, rtt_ms, core_layout) as linked:
        client = linked.client
        linked.compute.run(lambda: client.generate(TASKS[0], 16))  # warms both sides up
        for setting in ("off", "on"):
            client.suffixes = SuffixCache() if setting == "on" else None
            runs[setting] = _session(client, max_new_tokens, linked.compute.run)
            for which in PASSES:
                s = _summary([r for r in runs[setting] if r["pass"] == which])
                progress(f"{model} suffix cache {setting}, {which} pass: {s['tokens_per_step']:.2f} tok/step, "
                         f"{s['tokens_per_second']:.2f} tok/s, client CPU {s['client_cpu_ms_per_token']:.1f} ms/token")
        client.suffixes = None
    rows = []
    for which in PASSES:
        for setting in ("off", "on"):
            mine = [r for r in runs[setting] if r["pass"] == which]
            same = sum(a["ids"] == b["ids"] for a, b in zip(mine, (r for r in runs["off"] if r["pass"] == which)))
            rows.append({"pass": which, "suffix_cache": setting, **_summary(mine), "identical": same,
                         "requests": len(mine)})
    return {"model": model, "precision": linked.precision.name, "rows": rows, "runs": runs}


def run_suffix(models: Sequence[str], rtt_ms: float, max_new_tokens: int, core_layout: str,
               progress: Callable[[str], None]) -> dict:
    settings = {"models": list(models), "rtt_ms": rtt_ms, "max_new_tokens": max_new_tokens, "tasks": len(TASKS),
                "core_layout": core_layout, "decode": "auto"}
    return {"settings": settings, "models": [measure_model(m, rtt_ms, max_new_tokens, core_layout, progress)
                                             for m in models]}


def markdown(result: dict) -> str:
    s, p = result["settings"], result["provenance"]
    lines = [
        f"A coding session of {s['tasks']} requests (one system prompt, tasks of one kind), each a fresh "
        f"conversation, then the same requests again; `{s['decode']}` at {s['rtt_ms']:g} ms, up to "
        f"{s['max_new_tokens']} tokens each, each side on its own cores ({s['core_layout']}). "
        f"{p['date'][:10]}, `{p['git_commit'][:10]}`, {p['cpu']}.",
        "",
        "| model | pass | suffix cache | tokens / step | tok/s | client CPU ms / token | tokens drafted from earlier "
        "requests | same answers as off |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in result["models"]:
        for r in m["rows"]:
            lines.append(
                f"| {m['model']} | {r['pass']} | {r['suffix_cache']} | {r['tokens_per_step']:.2f} "
                f"| {r['tokens_per_second']:.2f} | {r['client_cpu_ms_per_token']:.1f} | {r['suffix_share']:.0%} "
                f"| {r['identical']}/{r['requests']} |"
            )
    return "\n".join(lines) + "\n"
