"""Tool calls as the Qwen2.5 chat template asks for them: found in the output, or forced by a grammar.

The template lists the tools in its system block and asks for each call as
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (the Hermes format, also what vLLM's and
llama.cpp's servers parse for these models). With `tool_choice` "auto" the model decides and its
calls are read out of the text: tagged, or, as the small Qwen2.5-Coder models often answer, a whole
answer that is a call object in a ```json fence (llama.cpp reads those too). "required" or a named
function constrain the output with a grammar (decoding/grammar.py), so the model can only answer with
well-formed calls to the tools offered.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import llguidance
from transformers import PreTrainedTokenizerBase

from splitllm.decoding.grammar import Grammar, json_rule

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


def takes_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the model's chat template renders tools and asks for calls in the format parsed here."""
    template = tokenizer.chat_template or ""
    return "tools" in template and OPEN in template


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    def openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


_FENCED = re.compile(r"\s*(?:```(?:json)?)?\s*(.*?)\s*(?:```)?\s*", re.DOTALL)


def _call(value: Any) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments), f"call_{uuid.uuid4().hex[:24]}")


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _bare_calls(text: str, names: Collection[str]) -> list[ToolCall]:
    """Calls written without the tags: a whole answer that is a call object (or a list of them) to offered
    tools, bare or in a ```json fence, as the small Qwen2.5-Coder models often write them."""
    match = _FENCED.fullmatch(text)
    value = _json(match.group(1)) if match else None
    calls = [_call(v) for v in (value if isinstance(value, list) else [value])]
    return calls if calls and all(c is not None and c.name in names for c in calls) else []  # type: ignore[return-value]


class ToolCallReader:
    """Reads a growing output: the text before the first call streams as content, each call as it closes.

    Text that may be the start of a call (a tag, or an answer opening with a fence or a brace) is held
    back until it is known not to be one; if the output ends with something that is not a well-formed
    call to an offered tool, that text comes back as content."""

    def __init__(self, names: Collection[str]) -> None:
        self.names = set(names)
        self.calls: list[ToolCall] = []
        self._given = 0  # characters of the output given out as content
        self._parsed = 0  # characters of the output up to the end of the last call read

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """New content and newly closed calls, given the whole output so far."""
        new: list[ToolCall] = []
        for match in _CALL.finditer(text, self._parsed):
            call = _call(_json(match.group(1)))
            if call is None or call.name not in self.names:
                break
            new.append(call)
            self._parsed = match.end()
        if final and not self.calls and not new and self._given == 0:
            new = _bare_calls(text, self.names)
            self._parsed = len(text) if new else 0
        self.calls += new
        start = text.find(OPEN)
        if self.calls:
            end = max(start, 0)  # content stops where the calls begin
        elif final:  # no call, or one that never closed well-formed: the text is the answer
            end = len(text)
        elif start >= 0 or (self._given == 0 and _may_open(text)):
            end = start if start >= 0 else 0
        else:
            end = _safe_end(text)
        piece = text[self._given : end] if end > self._given else ""
        self._given = max(self._given, end)
        return piece, new

    def content(self, text: str) -> str | None:
        """The finished answer's content: the text before the calls (None if only calls), else all of it."""
        return text[: max(text.find(OPEN), 0)].strip() or None if self.calls else text


def _may_open(text: str) -> bool:
    """Whether an answer so far may still turn out to be one bare call (see `_bare_calls`)."""
    head = text.lstrip()
    return not head or head.startswith(("{", "[", "```")) or "```".startswith(head)


def _safe_end(text: str) -> int:
    """How much of `text` cannot be the beginning of a call: all but a tail that is a prefix of OPEN."""
    for keep in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)


def call_grammar(
    tokenizer: llguidance.LLTokenizer, tools: list[dict[str, Any]], only: str | None, parallel: bool
) -> Grammar:
    """Output that is one call (or, with `parallel`, several) to the offered tools, or to `only`."""
    functions = [t["function"] for t in tools if only is None or t["function"]["name"] == only]
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    lark = f'start: call{"+" if parallel else ""}\ncall: {OPEN} "\\n" body "\\n" {CLOSE}\nbody: {json_rule(schema)}\n'
    return Grammar.lark(tokenizer, lark)
