"""`splitllm bench conversation`: a chat's follow-up turn through the OpenAI endpoint, continued against fresh.

A server subprocess behind the WAN proxy, and `client-api`'s app in this process driven by the official
`openai` client as a chat tool drives it: a first turn of a long document and a question, then a
follow-up that re-sends the whole history. The follow-up goes once to an endpoint that keeps
conversations (it reads only the new tokens) and once to one that keeps none (it reads the whole
history again); the figure is the time to the first streamed token of each.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from splitllm.api.openai import create_app
from splitllm.client.conversations import ReuseLimits
from splitllm.client.client import SplitClient
from splitllm.lab.data.workload import workload
from splitllm.testing.launch import client_over_link, serve_http


def _document(client: SplitClient, tokens: int) -> str:
    """About `tokens` tokens of the workload's prompts, one after another, as a long pasted document."""
    texts = [p.text for p in workload()]
    doc, i = "", 0
    while len(client.tokenizer(doc)["input_ids"]) < tokens:
        doc += texts[i % len(texts)] + "\n\n"
        i += 1
    return doc


def _first_token_ms(api, messages: list[dict], max_tokens: int) -> tuple[float, str,  # type: ignore[no-untyped-def]
                                                                         dict]:
    """Time to the first streamed text, the whole answer, and the last chunk's splitllm statistics."""
    t0 = time.perf_counter()
    first, text, extra = None, "", {}
    for chunk in api.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, temperature=0,
                                             stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or (time.perf_counter() - t0) * 1000
            text += chunk.choices[0].delta.content
        extra = (chunk.model_extra or {}).get("splitllm", extra)
    return first or (time.perf_counter() - t0) * 1000, text, extra


def measure_model(model: str, rtt_ms: float, tokens: int, chats: int, core_layout: str,
                  progress: Callable[[str], None]) -> dict:
    import openai

    rows = []
    with client_over_link(model, rtt_ms, core_layout) as linked:
        client, compute, precision = linked.client, linked.compute, linked.precision
        apps = {name: create_app(client, "m", compute=compute, reuse=ReuseLimits(max_conversations=n))
                for name, n in (("continued", 8), ("fresh", 0))}
        with serve_http(apps["continued"]) as kept_url, serve_http(apps["fresh"]) as fresh_url:
            api = {name: openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
                   for name, url in (("continued", kept_url), ("fresh", fresh_url))}
            doc = _document(client, tokens)
            for i in range(chats + 1):  # the first chat warms both sides up
                messages = [{"role": "user", "content": f"{doc}\nChat {i}: summarize the text above in one sentence."}]
                first_ms, answer, ext = _first_token_ms(api["continued"], messages, 32)
                messages += [{"role": "assistant", "content": answer},
                             {"role": "user", "content": "Now name its main topic in two words."}]
                results = {name: _first_token_ms(api[name], messages, 16) for name in ("continued", "fresh")}
                if i == 0:
                    continue
                row = {
                    "first_turn_prompt_tokens": ext.get("prompt_tokens", 0), "first_turn_first_token_ms": first_ms,
                    "continued_ms": results["continued"][0], "fresh_ms": results["fresh"][0],
                    "continued_reused_tokens": results["continued"][2].get("reused_prompt_tokens", 0),
                    "identical": results["continued"][1] == results["fresh"][1],
                }
                rows.append(row)
                progress(f"{model} chat {i}: follow-up first token {row['continued_ms']:.0f} ms continued, "
                         f"{row['fresh_ms']:.0f} ms fresh")
    continued, fresh = sum(r["continued_ms"] for r in rows), sum(r["fresh_ms"] for r in rows)
    return {"model": model, "precision": precision.name, "rtt_ms": rtt_ms, "chats": rows,
            "ratio": continued / fresh if fresh else 0.0}


def run_conversation(models: Sequence[str], rtt_ms: float, tokens: int, chats: int, core_layout: str,
                     progress: Callable[[str], None]) -> dict:
    settings = {"models": list(models), "rtt_ms": rtt_ms, "first_turn_tokens": tokens, "chats": chats,
                "core_layout": core_layout}
    return {"settings": settings,
            "rows": [measure_model(m, rtt_ms, tokens, chats, core_layout, progress) for m in models]}


def markdown(result: dict) -> str:
    s, p = result["settings"], result["provenance"]
    lines = [
        "A chat's follow-up turn through `client-api` (the official `openai` client, streaming) "
        f"at {s['rtt_ms']:g} ms, after a first turn of about {s['first_turn_tokens']} tokens; {s['chats']} chats; "
        f"each side on its own cores ({s['core_layout']}). {p['date'][:10]}, `{p['git_commit'][:10]}`, {p['cpu']}.",
        "",
        "| model | first turn, prompt tokens | follow-up first token, continued ms | fresh ms | continued / fresh "
        "| same answer |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        chats = r["chats"]
        mean = lambda key, chats=chats: sum(c[key] for c in chats) / len(chats)  # noqa: E731
        lines.append(
            f"| {r['model']} | {mean('first_turn_prompt_tokens'):.0f} | {mean('continued_ms'):.0f} "
            f"| {mean('fresh_ms'):.0f} | {r['ratio']:.2f}x | {sum(c['identical'] for c in chats)}/{len(chats)} |"
        )
    return "\n".join(lines) + "\n"
