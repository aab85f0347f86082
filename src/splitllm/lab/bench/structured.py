"""`splitllm bench structured`: JSON schemas and tool calls through `client-api`, and what the grammar costs.

Two parts. The grammar libraries' per-token mask cost on this CPU: each walks a schema-valid JSON text
token by token, computing the mask of allowed tokens and taking the next token, on every model's
vocabulary (llguidance, which the runtime uses, and xgrammar and outlines-core when installed).
Then each packaged model over a server subprocess behind the WAN proxy, driven by the official
`openai` client: JSON-schema answers decoded sequentially and with `auto` (validity, tok/s, whether
the outputs are identical), and, where the chat template takes tools, tool calls streamed and not.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from splitllm.api.openai import create_app
from splitllm.client.conversations import ReuseLimits
from splitllm.api.tools import takes_tools
from splitllm.client.client import SplitClient
from splitllm.decoding.grammar import JSON_STYLE, Grammar, grammar_tokenizer
from splitllm.testing.launch import client_over_link, serve_http

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 32}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                   "country": {"type": "string", "maxLength": 40}},
                    "required": ["city", "country"], "additionalProperties": False},
    },
    "required": ["name", "age", "skills", "address"],
    "additionalProperties": False,
}
SAMPLE = {"name": "Ada Lovelace", "age": 36, "skills": ["mathematics", "poetry", "engines"],
          "address": {"city": "London", "country": "United Kingdom"}}
ASKS = [
    "Describe a software engineer you invent, as JSON.",
    "Give me a fictional chef's profile.",
    "Invent a character for a mystery novel.",
    "Describe a retired astronaut.",
]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def _walk_ms(step: Callable[[Any, int], None], start: Callable[[], Any], ids: list[int],
             repeats: int = 5) -> list[float]:
    times = []
    for _ in range(repeats):
        state = start()
        for token in ids:
            t0 = time.perf_counter()
            step(state, token)
            times.append((time.perf_counter() - t0) * 1000)
    return times


def _llguidance(client: SplitClient, ids: list[int]) -> list[float]:
    """Mask (as the sampler applies it: a bool tensor over the logits) and advance, per token."""
    vocab = client.files.hf_config.vocab_size
    grammar = Grammar.json_schema(grammar_tokenizer(client.tokenizer, vocab, client.stop_ids), PERSON)

    def step(state: Any, token: int) -> None:
        assert state.allowed(vocab)[token]
        state.advance(token)

    return _walk_ms(step, grammar.start, ids)


def _xgrammar(client: SplitClient, ids: list[int]) -> list[float]:
    import torch
    import xgrammar

    vocab = client.files.hf_config.vocab_size
    info = xgrammar.TokenizerInfo.from_huggingface(client.tokenizer, vocab_size=vocab)
    compiled = xgrammar.GrammarCompiler(info, max_threads=1).compile_json_schema(
        json.dumps(PERSON), any_whitespace=False,
        separators=(JSON_STYLE["item_separator"], JSON_STYLE["key_separator"]))
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)

    def step(matcher: Any, token: int) -> None:
        matcher.fill_next_token_bitmask(bitmask)
        allowed = torch.from_numpy(np.unpackbits(bitmask.numpy().view(np.uint8),
                                                 bitorder="little")[:vocab].astype(bool))
        assert allowed[token] and matcher.accept_token(token)

    return _walk_ms(step, lambda: xgrammar.GrammarMatcher(compiled), ids)


class _Unsupported(Exception):
    """A library that could not be measured on a model."""


def _token_bytes(vocab: dict[str, int]) -> dict[bytes, list[int]]:
    """Each token's bytes: byte-level BPE through GPT-2's byte map, SentencePiece through its '▁' and
    <0xXX> tokens."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in printable]
    byte_of = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(extra)}
    byte_level = any("Ġ" in t for t in vocab)
    out: dict[bytes, list[int]] = {}
    for text, i in vocab.items():
        if byte_level:
            if not all(c in byte_of for c in text):
                continue
            raw = bytes(byte_of[c] for c in text)
        else:
            hex_byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", text)
            raw = bytes([int(hex_byte.group(1), 16)]) if hex_byte else text.replace("▁", " ").encode()
        out.setdefault(raw, []).append(i)
    return out


def _outlines_core(client: SplitClient, ids: list[int]) -> list[float]:
    """outlines-core wants the vocabulary as bytes (`_token_bytes`)."""
    import torch
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    eos = client.tokenizer.eos_token_id
    vocab_bytes = {k: [i for i in v if i != eos] for k, v in _token_bytes(client.tokenizer.get_vocab()).items()}
    vocab_bytes = {k: v for k, v in vocab_bytes.items() if v}
    index = Index(build_regex_from_schema(json.dumps(PERSON), r"( )?"), Vocabulary(eos, vocab_bytes))
    vocab = client.files.hf_config.vocab_size
    mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

    def step(guide: Any, token: int) -> None:
        guide.write_mask_into(mask.data_ptr(), mask.numel(), 4)
        allowed = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[:vocab].astype(bool)
        if not allowed[token]:
            raise _Unsupported(
                "outlines-core refused a token of the valid text: its vocabulary was not rebuilt faithfully"
            )
        guide.advance(token)

    return _walk_ms(step, lambda: Guide(index), ids)


def mask_costs(client: SplitClient) -> list[dict]:
    """Each installed library's per-token mask cost on this model's vocabulary."""
    text = json.dumps(SAMPLE, separators=(JSON_STYLE["item_separator"], JSON_STYLE["key_separator"]))
    ids = client.tokenizer(text, add_special_tokens=False)["input_ids"]
    rows = []
    for name, walk in (("llguidance", _llguidance), ("xgrammar", _xgrammar), ("outlines-core", _outlines_core)):
        try:
            times = walk(client, ids)
        except ImportError:  # not installed: `pip install xgrammar outlines-core` to compare
            continue
        except _Unsupported as exc:
            rows.append({"library": name, "tokens": len(ids), "unsupported": str(exc)})
            continue
        rows.append({"library": name, "tokens": len(ids), "mean_ms": float(np.mean(times)),
                     "p50_ms": float(np.median(times)), "p99_ms": float(np.percentile(times, 99))})
    return rows


def _schema_runs(api: Any, chat: bool, max_tokens: int) -> dict:
    """Each ask decoded sequentially and with auto under the schema: validity, tok/s, identical outputs."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    runs: dict[str, list[dict]] = {"sequential": [], "auto": []}
    for ask in ASKS:
        for decode in runs:
            extra = {"decode": decode, "response_format": fmt}
            if chat:
                reply = api.chat.completions.create(model="m", messages=[{"role": "user", "content": ask}],
                                                    temperature=0, max_tokens=max_tokens, extra_body=extra)
                text = reply.choices[0].message.content
            else:
                prompt = f"{ask}\nAn example: {json.dumps(SAMPLE)}\nJSON: "  # a base model needs the example
                reply = api.completions.create(model="m", prompt=prompt, temperature=0, max_tokens=max_tokens,
                                               extra_body=extra)
                text = reply.choices[0].text
            try:
                valid = isinstance(json.loads(text), dict)
            except json.JSONDecodeError:
                valid = False
            ext = reply.model_extra["splitllm"]
            runs[decode].append({"text": text, "valid": valid, "finish_reason": reply.choices[0].finish_reason,
                                 "tokens_per_second": ext["tokens_per_second"],
                                 "tokens_per_step": ext["tokens_per_step"],
                                 "new_tokens": ext["new_tokens"]})
    return runs


def _tool_calls(api: Any) -> dict:
    """A tool call asked for in auto mode, not streamed and streamed: the calls each came back with."""
    kwargs = {"model": "m", "messages": TOOL_ASK, "tools": [WEATHER], "temperature": 0, "max_tokens": 48}
    reply = api.chat.completions.create(**kwargs)
    plain = [(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls or ()]
    streamed, finish = {}, None
    for chunk in api.chat.completions.create(stream=True, **kwargs):
        for call in (chunk.choices[0].delta.tool_calls or ()) if chunk.choices else ():
            streamed[call.index] = (call.function.name, call.function.arguments)
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    return {"calls": plain, "finish_reason": reply.choices[0].finish_reason,
            "streamed_calls": [streamed[i] for i in sorted(streamed)], "streamed_finish_reason": finish}


def measure_model(model: str, rtt_ms: float, max_tokens: int, core_layout: str,
                  progress: Callable[[str], None]) -> dict:
    import openai

    with client_over_link(model, rtt_ms, core_layout) as linked:
        client = linked.client
        row: dict[str, Any] = {"model": model, "precision": linked.precision.name, "masks": mask_costs(client)}
        progress(
            f"{model}: mask cost "
            + ", ".join(f"{m['library']} {m.get('mean_ms', float('nan')):.3f} ms" for m in row["masks"])
        )
        chat = bool(client.tokenizer.chat_template)
        # Each ask runs in both modes and as a warm-up: drafting from those earlier runs would flatter auto.
        with serve_http(create_app(client, "m", compute=linked.compute, reuse=ReuseLimits(suffix_tokens=0))) as url:
            api = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
            _schema_runs(api, chat, 16)  # warms both sides up
            row["schema"] = _schema_runs(api, chat, max_tokens)
            row["endpoint"] = "chat" if chat else "completions"
            if chat and takes_tools(client.tokenizer):
                row["tools"] = _tool_calls(api)
    seq, auto = row["schema"]["sequential"], row["schema"]["auto"]
    row["identical"] = sum(a["text"] == s["text"] for a, s in zip(auto, seq))
    row["speedup"] = _rate(auto) / _rate(seq) if _rate(seq) else 0.0
    progress(f"{model}: {sum(r['valid'] for r in auto + seq)}/{len(auto + seq)} valid, auto {_rate(auto):.2f} tok/s, "
             f"sequential {_rate(seq):.2f}, identical {row['identical']}/{len(auto)}")
    return row


def _rate(runs: Sequence[dict]) -> float:
    return float(np.mean([r["tokens_per_second"] for r in runs])) if runs else 0.0


def run_structured(models: Sequence[str], rtt_ms: float, max_tokens: int, core_layout: str,
                   progress: Callable[[str], None]) -> dict:
    settings = {"models": list(models), "rtt_ms": rtt_ms, "max_tokens": max_tokens, "asks": len(ASKS),
                "core_layout": core_layout}
    return {"settings": settings, "rows": [measure_model(m, rtt_ms, max_tokens, core_layout, progress) for m in models]}


def markdown(result: dict) -> str:
    s, p = result["settings"], result["provenance"]
    head = (f"{s['asks']} JSON-schema requests per model through `client-api` (the official `openai` client) at "
            f"{s['rtt_ms']:g} ms, each side on its own cores ({s['core_layout']}), up to {s['max_tokens']} tokens; "
            f"{p['date'][:10]}, `{p['git_commit'][:10]}`, {p['cpu']}.")
    lines = [head, "", "| model | valid JSON | auto tok/s | sequential tok/s | auto / sequential | identical "
             "| tool call, plain / streamed |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        runs = r["schema"]["sequential"] + r["schema"]["auto"]
        tools = r.get("tools")
        said = "n/a (template takes no tools)" if tools is None else (
            f"{len(tools['calls'])} / {len(tools['streamed_calls'])} ({tools['finish_reason']})")
        lines.append(f"| {r['model']} | {sum(x['valid'] for x in runs)}/{len(runs)} | {_rate(r['schema']['auto']):.2f} "
                     f"| {_rate(r['schema']['sequential']):.2f} | {r['speedup']:.2f}x | {r['identical']}/{len(ASKS)} "
                     f"| {said} |")
    lines += ["", "Grammar mask cost per token (compute the mask over the vocabulary, then take the token):", "",
              "| model | library | mean ms | p50 ms | p99 ms |", "| --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        for m in r["masks"]:
            if "unsupported" in m:
                lines.append(f"| {r['model']} | {m['library']} | not measured: {m['unsupported']} | | |")
                continue
            lines.append(
                f"| {r['model']} | {m['library']} | {m['mean_ms']:.3f} | {m['p50_ms']:.3f} | {m['p99_ms']:.3f} |"
            )
    return "\n".join(lines) + "\n"
