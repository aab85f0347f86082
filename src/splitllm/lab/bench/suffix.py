"""`splitllm bench suffix`: drafting from earlier requests (`SuffixCache`) on and off, over the WAN proxy.

Two sessions, each request a fresh conversation as an agent's calls are. A coding session: requests that
share a frame (one system prompt, tasks of one kind, answers of one shape), then the same requests
again (an agent's retries and regenerations). And the benchmark workload's unrelated prompts (code,
structured, creative, conversational), where earlier requests have little to offer. Each setting runs
both on the same client and server: `auto`'s tokens per step, tok/s and the client's CPU time per token
(this process, the proxy's forwarding included, as in `bench speculation`), and whether every answer
is the cache-off answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from splitllm.client.client import SplitClient
from splitllm.decoding.proposers.suffix import SuffixCache
from splitllm.lab.data.workload import workload
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


def _coding(client: SplitClient) -> list[list[int]]:
    prompts = []
    for task in TASKS:
        ids = client.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                    {"role": "user", "content": task}], add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def _run(client: SplitClient, prompts: Sequence[list[int]], max_new_tokens: int,
         run: Callable[[Callable[[], Any]], Any]) -> list[dict]:
    """Each prompt as a fresh conversation: its tokens, steps, time and client CPU."""
    rows = []
    for prompt in prompts:
        cpu = time.process_time()
        gen = run(lambda prompt=prompt: client.generate(prompt, max_new_tokens, decode="auto"))
        rows.append({"ids": gen.ids, "steps": len(gen.steps) - 1,  # less the prefill's
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


def measure_model(model: str, rtt_ms: float, max_new_tokens: int, per_category: int, core_layout: str,
                  progress: Callable[[str], None]) -> dict:
    runs: dict[str, dict[str, list[dict]]] = {"off": {}, "on": {}}  # setting -> part -> requests
    with client_over_link(model, rtt_ms, core_layout) as linked:
        client = linked.client
        linked.compute.run(lambda: client.generate(TASKS[0], 16))  # warms both sides up
        parts = {"coding, first": _coding(client), "coding, again": _coding(client),
                 "workload": [client.encode_prompt(p.text) for p in workload(per_category)]}
        for setting, part in runs.items():
            client.suffixes = SuffixCache() if setting == "on" else None  # one cache through both sessions
            for name, prompts in parts.items():
                part[name] = _run(client, prompts, max_new_tokens, linked.compute.run)
                s = _summary(part[name])
                progress(f"{model} suffix cache {setting}, {name}: {s['tokens_per_step']:.2f} tok/step, "
                         f"{s['tokens_per_second']:.2f} tok/s, client CPU {s['client_cpu_ms_per_token']:.1f} ms/token")
        client.suffixes = None
    rows = [{"part": name, "suffix_cache": setting, **_summary(runs[setting][name]), "requests": len(prompts),
             "identical": sum(a["ids"] == b["ids"] for a, b in zip(runs[setting][name], runs["off"][name]))}
            for name, prompts in parts.items() for setting in runs]
    return {"model": model, "precision": linked.precision.name, "rows": rows, "runs": runs}


def run_suffix(models: Sequence[str], rtt_ms: float, max_new_tokens: int, per_category: int, core_layout: str,
               progress: Callable[[str], None]) -> dict:
    settings = {"models": list(models), "rtt_ms": rtt_ms, "max_new_tokens": max_new_tokens, "tasks": len(TASKS),
                "prompts_per_category": per_category, "core_layout": core_layout, "decode": "auto"}
    return {"settings": settings, "models": [measure_model(m, rtt_ms, max_new_tokens, per_category, core_layout,
                                                           progress) for m in models]}


def markdown(result: dict) -> str:
    s, p = result["settings"], result["provenance"]
    lines = [
        f"Each request a fresh conversation: a coding session of {s['tasks']} requests (one system prompt, tasks "
        f"of one kind), the same {s['tasks']} again, then the benchmark workload ({s['prompts_per_category']} "
        f"prompts of each of its 4 categories); `{s['decode']}` at {s['rtt_ms']:g} ms, up to {s['max_new_tokens']} "
        f"tokens each, each side on its own cores ({s['core_layout']}). {p['date'][:10]}, `{p['git_commit'][:10]}`, "
        f"{p['cpu']}.",
        "",
        "| model | requests | suffix cache | tokens / step | tok/s | client CPU ms / token | tokens drafted from "
        "earlier requests | same answers as off |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in result["models"]:
        for r in m["rows"]:
            lines.append(
                f"| {m['model']} | {r['part']} | {r['suffix_cache']} | {r['tokens_per_step']:.2f} "
                f"| {r['tokens_per_second']:.2f} | {r['client_cpu_ms_per_token']:.1f} | {r['suffix_share']:.0%} "
                f"| {r['identical']}/{r['requests']} |"
            )
    return "\n".join(lines) + "\n"
