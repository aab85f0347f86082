"""The ways in for existing tools, against a live stack on loopback: a splitllm server, the
OpenAI-compatible endpoint driven by the official `openai` client, and the transformers-style class."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import openai
import pytest
import torch
from splitllm.testing.launch import serve_http
from transformers import TextIteratorStreamer, TextStreamer

from splitllm.api.hf import SplitModelForCausalLM
from splitllm.api.openai import create_app
from splitllm.api.tools import takes_tools
from splitllm.client.client import SplitClient
from splitllm.commands.client_commands import ClientSettings, served_client
from splitllm.commands.wiring import AskedPrecision
from splitllm.model.precision import EXACT
from splitllm.options import Split

from conftest import CHAT_CASES

QUESTION = "Name three colors."


@pytest.fixture(scope="module", params=CHAT_CASES)
def split_client(request, server, chat_split) -> SplitClient:  # type: ignore[no-untyped-def]
    """A model's client side, talking to a real server thread over loopback."""
    model, first, last = chat_split(request.param)
    return SplitClient(model, server(model, first, last).url, first=first, last=last)


@pytest.fixture(scope="module")
def api(split_client: SplitClient) -> Iterator[openai.OpenAI]:
    """An OpenAI client pointed at `create_app` served by uvicorn on a free loopback port."""
    with serve_http(create_app(split_client, "splitllm-test")) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _chat(api: openai.OpenAI, **kwargs):  # type: ignore[no-untyped-def]
    return api.chat.completions.create(
        model="splitllm-test", messages=[{"role": "user", "content": QUESTION}], **{"max_tokens": 24, **kwargs}
    )


def test_models_lists_the_served_model(api: openai.OpenAI) -> None:
    assert [m.id for m in api.models.list()] == ["splitllm-test"]


def test_chat_completion_matches_the_client(api: openai.OpenAI, split_client: SplitClient) -> None:
    reply = _chat(api, temperature=0)
    ref = split_client.generate(QUESTION, 24)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.finish_reason == ref.finish_reason
    assert reply.usage.prompt_tokens == len(ref.prompt_ids) and reply.usage.completion_tokens == len(ref.ids)
    assert reply.usage.total_tokens == len(ref.prompt_ids) + len(ref.ids)
    ext = reply.model_extra["splitllm"]
    assert ext["decode"] == "auto" and ext["tokens_per_step"] >= 1.0 and ext["tokens_per_second"] > 0
    assert ext["steps"] <= len(ref.ids) and ext["mean_step"]["round_trip_ms"] > 0


def test_chat_streaming_equals_non_streaming(api: openai.OpenAI) -> None:
    whole = _chat(api, temperature=0.7, seed=4, extra_body={"decode": "lookup"})
    chunks = list(_chat(api, temperature=0.7, seed=4, stream=True, stream_options={"include_usage": True},
                        extra_body={"decode": "lookup"}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and len(chunks) > 3
    last, usage = chunks[-2], chunks[-1]
    assert last.choices[0].finish_reason == whole.choices[0].finish_reason
    assert last.model_extra["splitllm"]["decode"] == "lookup"
    assert usage.choices == [] and usage.usage == whole.usage


def test_speculative_greedy_and_seeded_sampling_are_stable(api: openai.OpenAI) -> None:
    greedy = {mode: _chat(api, temperature=0,
                          extra_body={"decode": mode}).choices[0].message.content for mode in ("sequential", "auto")}
    assert greedy["sequential"] == greedy["auto"]
    sampled = [_chat(api, temperature=0.8, seed=9).choices[0].message.content for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_completions_with_stop_strings(api: openai.OpenAI, split_client: SplitClient) -> None:
    prompt = "The days of the week are Monday, Tuesday,"
    whole = split_client.generate(prompt, 30, chat=False).text
    stop = whole[len(whole) // 2 :][:3]  # a piece from the middle of the answer: it stops there
    reply = api.completions.create(model="x", prompt=prompt, max_tokens=30, temperature=0, stop=[stop])
    ref = split_client.generate(prompt, 30, chat=False, stop=[stop])
    assert reply.choices[0].text == ref.text == whole[: whole.index(stop)]
    assert reply.choices[0].finish_reason == "stop"
    streamed = api.completions.create(model="x", prompt=prompt, max_tokens=30, temperature=0, stop=[stop],
                                      stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "stop" and "splitllm" in chunks[-1].model_extra


def test_bad_requests_get_openai_errors(api: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="top_p"):
        _chat(api, top_p=1.5)
    with pytest.raises(openai.BadRequestError, match="unknown decode mode"):
        _chat(api, extra_body={"decode": "beam"})
    with pytest.raises(openai.BadRequestError, match="maximum context"):
        _chat(api, max_tokens=100_000)
    with pytest.raises(openai.BadRequestError, match="role"):  # a role the chat template does not know
        api.chat.completions.create(model="splitllm-test", messages=[{"role": "robot", "content": QUESTION}])
    with pytest.raises(openai.BadRequestError, match="logprobs"):  # never silently missing from the reply
        _chat(api, logprobs=True)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        api.completions.create(model="splitllm-test", prompt=QUESTION, max_tokens=4, logprobs=2)
    assert _chat(api, logprobs=False).choices[0].message.content


def test_a_field_the_endpoint_cannot_honour_is_a_400_naming_it(api: openai.OpenAI, split_client: SplitClient) -> None:
    """Never a reply that silently did without what was asked for."""
    tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
    refused = [
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"extra_body": {"beam_width": 4}}, "beam_width"),
        *([({"tools": [tool]}, "tools")] if not takes_tools(split_client.tokenizer) else []),
    ]
    for fields, name in refused:
        with pytest.raises(openai.BadRequestError, match=name):
            _chat(api, **fields)
    with pytest.raises(openai.BadRequestError, match="name"):
        api.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION, "name": "bob"}],
                                    max_tokens=2)
    honoured = _chat(api, max_tokens=2, response_format={"type": "text"}, frequency_penalty=0, user="u1",
                     extra_body={"tool_choice": None, "functions": None})  # null: as if not sent
    assert honoured.choices[0].finish_reason in ("stop", "length")


def test_a_follow_up_request_continues_its_conversation(api: openai.OpenAI, split_client: SplitClient) -> None:
    """Two chats interleaved, each re-sending its whole history: each follow-up goes on in its own
    conversation (reading only its new tokens) and answers as a fresh request of that history would."""
    chats = [[{"role": "user", "content": q}] for q in ("My name is Ada.", "Count to three.")]
    for messages in chats:
        reply = api.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "Say that again, shorter."}]
    for messages in chats:
        follow_up = api.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
        ext = follow_up.model_extra["splitllm"]
        assert 0 < ext["reused_prompt_tokens"] < follow_up.usage.prompt_tokens
        assert ext["prompt_tokens"] == follow_up.usage.prompt_tokens - ext["reused_prompt_tokens"]
        prompt = split_client.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        fresh = split_client.generate(split_client.tokenizer(prompt, add_special_tokens=False)["input_ids"], 12)
        assert follow_up.choices[0].message.content == fresh.text


def test_a_developer_message_is_a_system_message(api: openai.OpenAI) -> None:
    def ask(role: str) -> str:
        messages = [{"role": role, "content": "Answer in French."}, {"role": "user", "content": QUESTION}]
        reply = api.chat.completions.create(model="splitllm-test", messages=messages, max_tokens=12, temperature=0)
        return reply.choices[0].message.content
    assert ask("developer") == ask("system")


@pytest.fixture(scope="module")
def hf_split(server) -> SplitModelForCausalLM:  # type: ignore[no-untyped-def]
    """float32 throughout, as the transformers oracle: a lossy precision may break the oracle's near ties."""
    url = server(None, 2, 2, dtype=torch.float32).url
    return SplitModelForCausalLM.from_pretrained("default", server=url, wire_dtype="float32", precision=EXACT)


@pytest.fixture(scope="module")
def hf_fast(server) -> SplitModelForCausalLM:  # type: ignore[no-untyped-def]
    """Both sides in the fastest setting here, where speculation reproduces sequential decoding."""
    return SplitModelForCausalLM.from_pretrained("default", server=server(None, 2, 2).url)


@pytest.mark.slow
def test_hf_generate_matches_transformers(hf_split: SplitModelForCausalLM,  # type: ignore[no-untyped-def]
                                          hf_greedy) -> None:
    prompt = hf_split.tokenizer("The capital of France is")["input_ids"]
    out = hf_split.generate(torch.tensor([prompt]), max_new_tokens=12)
    assert out.dtype == torch.long and out.shape == (1, len(prompt) + 12)
    assert out[0].tolist() == prompt + hf_greedy(None, prompt, 12)


@pytest.mark.slow
def test_hf_streamers_get_every_step(hf_fast: SplitModelForCausalLM, capsys: pytest.CaptureFixture[str]) -> None:
    hf_split = hf_fast
    tok = hf_split.tokenizer
    ids = torch.tensor([tok("Once upon a time")["input_ids"]])
    out = hf_split.generate(ids, max_new_tokens=16, streamer=TextStreamer(tok, skip_prompt=True), decode="lookup")
    new_text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert capsys.readouterr().out.strip() == new_text.strip()

    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    kwargs = dict(max_new_tokens=16, do_sample=True, temperature=0.7, seed=2, streamer=streamer)
    worker = threading.Thread(target=lambda: hf_split.generate(ids, **kwargs))
    worker.start()
    pieces = list(streamer)
    worker.join()
    kwargs.pop("streamer")
    again = hf_split.generate(ids, **kwargs)  # same seed, no streamer: the same sample
    assert "".join(pieces) == tok.decode(again[0, ids.shape[1] :], skip_special_tokens=True)


@pytest.mark.slow
def test_hf_batch_is_right_padded(hf_split: SplitModelForCausalLM) -> None:
    tok = hf_split.tokenizer
    rows = [tok("Hello")["input_ids"], tok("The three primary colors are")["input_ids"]]
    out = hf_split.generate(rows, max_new_tokens=4, pad_token_id=-1)
    assert out.shape == (2, max(map(len, rows)) + 4)
    assert out[0, len(rows[0]) + 4 :].tolist() == [-1] * (len(rows[1]) - len(rows[0]))
    assert out[1, : len(rows[1])].tolist() == rows[1]


@pytest.mark.slow
def test_client_api_loads_and_generates_on_one_compute_thread(stage_threads) -> None:
    """`client-api` builds its client where the endpoint then runs every generation: one thread pool
    for PyTorch, as on a server (threads.ComputeThread)."""
    # the default model, its middle in-process
    split_client, compute = served_client(Split(), ClientSettings(threads=1), AskedPrecision())
    with serve_http(create_app(split_client, "splitllm-test", compute=compute)) as url:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        reply = api.completions.create(model="splitllm-test", prompt=QUESTION, max_tokens=4)
    # not the text: after this raw prompt, "\n" leads the end of turn by 0.5 logits in float32, and the
    # int8 kernels of another CPU may order them the other way
    assert reply.usage.completion_tokens >= 1 and reply.choices[0].finish_reason in {"stop", "length"}
    assert {what for what, _, _ in stage_threads} == {"load", "forward"}
    assert {name for _, _, name in stage_threads} == {compute.run(lambda: threading.current_thread().name)}


def test_api_keys_admit_their_holders_and_keep_their_conversations_apart(split_client: SplitClient) -> None:
    app = create_app(split_client, "m", api_keys=frozenset({"key-a", "key-b"}))
    with serve_http(app) as url:
        def api(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)

        for bad in ("-", "key-c", "KEY-A"):
            with pytest.raises(openai.AuthenticationError, match="API key"):
                api(bad).models.list()
        messages = [{"role": "user", "content": "My name is Ada."}]
        reply = api("key-a").chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "What is my name?"}]
        other = api("key-b").chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0)
        assert other.model_extra["splitllm"]["reused_prompt_tokens"] == 0  # key a's conversation: not for key b
        mine = api("key-a").chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0)
        assert mine.model_extra["splitllm"]["reused_prompt_tokens"] > 0


@pytest.mark.slow
def test_max_context_defaults_to_the_models_limit_and_caches_take_what_the_server_grants(
    server, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    from splitllm.client import client

    split_client = SplitClient(None, server(None, 2, 2).url, first=2, last=2)
    limit = split_client.files.config.max_position
    assert split_client.max_context == limit > 4096  # the server below grants its default, 4096
    with split_client.conversation() as conv:
        list(conv.stream(split_client.encode_prompt(QUESTION), 2, "sequential"))
        assert conv._pipeline is not None and conv._pipeline.caches.first.max_context == 4096
    with pytest.raises(ValueError, match="model's limit"):
        SplitClient(None, split_client.server, max_context=limit + 1)
    monkeypatch.setattr(client, "_available_bytes", lambda: 1 << 20)
    with pytest.raises(ValueError, match="GiB available"):
        SplitClient(None, max_context=limit)
