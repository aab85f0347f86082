"""Tools and JSON output through the OpenAI endpoint, with the official `openai` client, over a real
server on loopback: tool calls (streamed and not, chosen and forced), a tool's answer continuing the
chat, JSON schemas on every packaged model, and the requests that must be refused."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from splitllm.api.openai import create_app
from splitllm.client.client import SplitClient
from splitllm.testing.launch import serve_http

from conftest import DEFAULT_MODEL_CASE

# Bounded values (enums, short strings), so that whatever a random model picks, a forced call or answer ends
# within its tokens; the real models answer these as they would unbounded ones.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                       "required": ["city"], "additionalProperties": False},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
NAME = {"type": "string", "maxLength": 12}
CITY = {
    "type": "object",
    "properties": {"city": NAME, "country": NAME, "landmarks": {"type": "array", "items": NAME, "maxItems": 3}},
    "required": ["city", "country", "landmarks"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=["tiny-chat", pytest.param("qwen2.5-coder-0.5b", marks=pytest.mark.slow),
                                        DEFAULT_MODEL_CASE])
def api(request: pytest.FixtureRequest, server, chat_split) -> Iterator[tuple[str, openai.OpenAI]]:  # type: ignore[no-untyped-def]
    """An OpenAI client on `client-api`'s app over a real server thread: the tiny model and the smaller Qwen
    (their templates take tools), and the default model (its template does not)."""
    model, first, last = chat_split(request.param)
    client = SplitClient(model, server(model, first, last).url, first=first, last=last)
    with serve_http(create_app(client, "m")) as url:
        yield request.param, openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)


def _stream(api: openai.OpenAI, **kwargs) -> tuple[str, list[dict], str]:  # type: ignore[no-untyped-def]
    """Content, tool calls (accumulated as OpenAI's clients do) and finish reason of a streamed chat."""
    content, calls, finish = "", {}, ""
    for chunk in api.chat.completions.create(model="m", stream=True, **kwargs):
        choice = chunk.choices[0] if chunk.choices else None
        if choice is None:
            continue
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or ():
            slot = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
            slot["name"] += call.function.name or ""
            slot["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def _offered(name: str, arguments: dict) -> bool:  # type: ignore[type-arg]
    """Whether a call names an offered tool with arguments its enums allow."""
    tool = {t["function"]["name"]: t["function"]["parameters"]["properties"] for t in (WEATHER, TIME)}.get(name)
    return tool is not None and all(k in tool and v in tool[k]["enum"] for k, v in arguments.items())


def test_tool_calls_come_back_as_tool_calls_streamed_or_not(api) -> None:  # type: ignore[no-untyped-def]
    name, client = api
    if name == "default":
        pytest.skip("the default model's template takes no tools (see the refusals below)")
    # A trained model calls the tool the question asks for, by its own choice too; a random one only as forced.
    for choice in ("required",) if name == "tiny-chat" else ("auto", "required"):
        kwargs = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": choice, "temperature": 0, "max_tokens": 96,
                  "parallel_tool_calls": name != "tiny-chat"}  # one call, or a random model calls on and on
        reply = client.chat.completions.create(model="m", **kwargs)
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls", message
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
        if name == "tiny-chat":
            assert calls and all(_offered(*call) for call in calls), calls
        else:
            assert calls == [("get_weather", {"city": "Paris"})]
        content, calls, finish = _stream(client, **kwargs)
        assert finish == "tool_calls" and not content.strip()
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in message.tool_calls
        ]
    forced = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME], temperature=0,
                                            max_tokens=96, parallel_tool_calls=name != "tiny-chat",
                                            tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [c.function.name for c in forced.choices[0].message.tool_calls] == ["get_time"]  # the grammar's doing
    plain = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


def test_a_tools_answer_continues_the_chat(api) -> None:  # type: ignore[no-untyped-def]
    name, client = api
    if name == "default":
        pytest.skip("the default model's template takes no tools")
    first = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="required",
                                           temperature=0, max_tokens=96,  # the tiny model's tokens are characters
                                           parallel_tool_calls=name != "tiny-chat")
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "It is 31 degrees Celsius and sunny in Paris."}]
    answer = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER], tool_choice="none",
                                            temperature=0, max_tokens=40)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.content
    ext = answer.model_extra["splitllm"]  # the tool's answer was read after the call's turn
    assert answer.usage.prompt_tokens == ext["reused_prompt_tokens"] + ext["prompt_tokens"]
    assert ext["prompt_tokens"] > len("It is 31 degrees Celsius and sunny in Paris.".split())
    assert answer.model_extra["splitllm"]["reused_prompt_tokens"] > 0  # the call's turn was continued, not re-read


def test_json_schema_output_is_valid_and_speculation_changes_nothing(api) -> None:  # type: ignore[no-untyped-def]
    name, client = api
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    texts = {}
    for decode in ("sequential", "auto"):
        reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Describe Paris."}],
                                               temperature=0, max_tokens=96, response_format=fmt,
                                               extra_body={"decode": decode})
        assert reply.choices[0].finish_reason == "stop"
        texts[decode] = reply.choices[0].message.content
        value = json.loads(texts[decode])
        assert set(value) == {"city", "country", "landmarks"} and len(value["landmarks"]) <= 3
    assert texts["sequential"] == texts["auto"]
    anything = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Two fruits?"}],
                                              temperature=0, max_tokens=48, response_format={"type": "json_object"})
    if name != "tiny-chat" or anything.choices[0].finish_reason == "stop":  # a random model's strings run on
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    content, _, finish = _stream(client, messages=[{"role": "user", "content": "Describe Paris."}], temperature=0,
                                 max_tokens=96, response_format=fmt)
    assert finish == "stop" and content == texts["auto"]


def test_what_cannot_be_honoured_is_a_400_naming_it(api) -> None:  # type: ignore[no-untyped-def]
    name, client = api
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "two"}}}
    refused = [({"response_format": fmt}, "grammar"),
               ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": CITY, "extra": 1}}},
                "extra")]
    if name == "default":
        refused += [({"tools": [WEATHER]}, "takes no tools")]
    else:
        refused += [
            ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
            ({"tool_choice": "required"}, "offers no tools"),
            ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "pick one"),
            ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {
                "name": "get_weather", "arguments": "Paris"}}]}]}, "not a JSON object"),
        ]
    for fields, match in refused:
        with pytest.raises(openai.BadRequestError, match=match):
            client.chat.completions.create(model="m", **{"messages": ASK, "max_tokens": 4, **fields})
