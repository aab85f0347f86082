"""Conversations kept between requests: which one a prompt continues, and the bounds on keeping them."""

from __future__ import annotations

import pytest

from splitllm.client.conversations import ConversationCache, ReuseLimits
from splitllm.client.client import SplitClient

from conftest import CHAT_CASES



@pytest.fixture(scope="module", params=CHAT_CASES)
def client(request, chat_split) -> SplitClient:  # type: ignore[no-untyped-def]
    model, first, last = chat_split(request.param)
    return SplitClient(model, first=first, last=last)  # the middle in-process


def _run(cache: ConversationCache, prompt: list[int], new: int = 4) -> tuple[list[int], int]:
    items = list(cache.stream(prompt, new, "sequential"))
    gen, _, held = items[-1]
    return prompt + gen.ids, held


def test_a_prompt_continues_the_conversation_it_extends_and_no_other(client: SplitClient) -> None:
    cache = ConversationCache(client)
    a, held = _run(cache, client.encode_prompt("Tell me about cats."))
    assert held == 0
    b, _ = _run(cache, client.encode_prompt("Tell me about dogs."))
    continued, held = _run(cache, a + client.encode_prompt("And lions?"))
    assert held == len(a)  # the whole of conversation a, nothing of b
    fresh, _ = _run(ConversationCache(client, ReuseLimits(max_conversations=0)), a + client.encode_prompt("And lions?"))
    assert continued == fresh
    _, held = _run(cache, a[:-1] + [a[-1] + 1] + client.encode_prompt("x"))  # differs inside a: not a prefix
    assert held == 0
    _, held = _run(cache, list(b))  # no new token beyond b: read afresh
    assert held == 0


def test_kept_conversations_are_bounded_in_count_bytes_and_time(client: SplitClient) -> None:
    prompts = [client.encode_prompt(f"Question {i}?") for i in range(3)]
    cache = ConversationCache(client, ReuseLimits(max_conversations=2))
    for p in prompts:
        _run(cache, p)
    assert len(cache) == 2
    one = next(iter(cache._kept.values())).conversation.nbytes
    assert one > 0
    small = ConversationCache(client, ReuseLimits(max_bytes=one))
    for p in prompts:
        _run(small, p)
    assert len(small) == 1  # the newest; the others were dropped to fit
    idle = ConversationCache(client, ReuseLimits(idle_s=0.0))
    first, _ = _run(idle, prompts[0])
    _, held = _run(idle, first + prompts[1])
    assert held == 0 and len(idle) == 1  # the first had expired before the second came
    cache.close()
    assert len(cache) == 0


@pytest.mark.slow
def test_a_prompt_whose_text_extends_a_conversation_continues_it_in_the_models_own_tokens() -> None:
    """A model's tokens may split a text other than the tokenizer would (forced tool calls often do): given
    the prompt's text, the conversation whose text it extends goes on, keeping its own tokens. (The tiny
    tokenizer splits every text one way: this needs the default model's merges.)"""
    client = SplitClient(None, first=2, last=2)
    tok = client.tokenizer
    odd = [t for ch in "Tell me about cats." for t in tok(ch, add_special_tokens=False)["input_ids"]]
    assert odd != tok("Tell me about cats.", add_special_tokens=False)["input_ids"]
    cache = ConversationCache(client)
    held_ids, _ = _run(cache, odd)
    text = tok.decode(held_ids) + " And dogs?"
    canonical = tok(text, add_special_tokens=False)["input_ids"]
    items = list(cache.stream(canonical, 4, "sequential", text=text))
    gen, _, held = items[-1]
    assert held == len(held_ids) and gen.prompt_ids == tok(" And dogs?", add_special_tokens=False)["input_ids"]
    _, _, held = list(cache.stream(canonical, 4, "sequential"))[-1]  # tokens alone: no prefix, read afresh
    assert held == 0
