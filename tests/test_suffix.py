"""Drafting from earlier requests (`SuffixCache`): what it finds and keeps, that it speeds up what repeats
and changes no token, and that one API key's requests never draft for another's."""

from __future__ import annotations

import openai
import pytest

from splitllm.api.openai import create_app
from splitllm.client.client import SplitClient
from splitllm.client.conversations import ReuseLimits
from splitllm.decoding.proposers.suffix import SuffixCache, SuffixLookup
from splitllm.decoding.sizing.budget import SpecBudget
from splitllm.testing.launch import serve_http

from conftest import TINY_SPLIT


def test_the_longest_then_newest_continuations_come_first_and_the_oldest_sequences_go() -> None:
    cache = SuffixCache(max_tokens=12, max_ngram=3, min_ngram=2)
    cache.add([1, 2, 3, 4, 5])
    cache.add([9, 2, 3, 7, 8])
    assert cache.continuations([1, 2, 3], depth=2, limit=4) == [((4, 5), 3), ((7, 8), 2)]
    assert cache.continuations([0, 2, 3], depth=5, limit=1) == [((7, 8), 2)]  # the newest; it ends there
    assert cache.continuations([3], depth=2, limit=4) == []  # shorter than the shortest n-gram
    cache.add([6])  # too short to continue anything: not kept
    assert len(cache) == 2 and cache.tokens == 10
    cache.add([5, 5, 5, 5])  # 14 tokens: the oldest sequence goes, and its places with it
    assert len(cache) == 2 and cache.tokens == 9
    assert cache.continuations([1, 2, 3], depth=2, limit=4) == [((7, 8), 2)]
    for _ in range(50):  # dropped sequences' index entries are swept once they outnumber the live ones
        cache.add([5, 5, 5, 5])
    assert sum(map(len, cache._ends.values())) <= 2 * 2 * cache.tokens
    with pytest.raises(ValueError, match="at least one token"):
        SuffixCache(max_tokens=0)


def test_the_lookup_proposes_within_its_budget() -> None:
    cache = SuffixCache()
    for tail in (7, 8, 9):
        cache.add([1, 2, 3, tail, tail + 1])
    lookup = SuffixLookup(cache)
    candidates = lookup.propose([5, 1, 2, 3], SpecBudget(guesses=2, depth=1))
    assert [c.tokens for c in candidates] == [(9,), (8,)] and {c.source for c in candidates} == {"suffix"}
    assert lookup.propose([5, 1, 2, 3], SpecBudget(guesses=0, depth=4)) == []
    assert lookup.propose([5, 9, 2, 3], SpecBudget(guesses=2, depth=1)) == []  # two tokens match: too few


def test_a_repeated_request_drafts_from_the_first_and_gives_its_tokens(tiny_chat: str) -> None:
    """The second generation of one prompt accepts several tokens a step from the first's answer, and both
    are the sequential tokens; without a cache the two run alike."""
    cache = SuffixCache()
    client = SplitClient(tiny_chat, first=TINY_SPLIT[0], last=TINY_SPLIT[1], suffixes=cache)
    first, again = (client.generate("Count to ten.", 48, decode="lookup") for _ in range(2))
    plain = SplitClient(tiny_chat, first=TINY_SPLIT[0], last=TINY_SPLIT[1])
    assert first.ids == again.ids == plain.generate("Count to ten.", 48, decode="sequential").ids
    assert plain.generate("Count to ten.", 48, decode="lookup").tokens_per_step == first.tokens_per_step
    assert again.tokens_per_step > max(3.0, first.tokens_per_step)
    assert sum(s.speculation.sources.get("suffix", 0) for s in again.steps) > len(again.ids) / 2
    assert len(cache) == 2  # each generation joined it


def test_one_keys_requests_draft_for_its_later_ones_never_for_another_keys(tiny_chat: str, server) -> None:  # type: ignore[no-untyped-def]
    url = server(tiny_chat, *TINY_SPLIT).url
    client = SplitClient(tiny_chat, url, first=TINY_SPLIT[0], last=TINY_SPLIT[1])
    app = create_app(client, "m", api_keys=frozenset({"key-a", "key-b"}))
    ask = {"model": "m", "messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 48,
           "temperature": 0, "extra_body": {"decode": "lookup"}}
    with serve_http(app) as base:
        def chat(key: str):  # type: ignore[no-untyped-def]
            api = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
            reply = api.chat.completions.create(**ask)
            return reply.choices[0].message.content, reply.model_extra["splitllm"]["tokens_per_step"]
        (first, first_rate), (again, again_rate), (other, other_rate) = chat("key-a"), chat("key-a"), chat("key-b")
    assert first == again == other
    assert again_rate > max(3.0, first_rate) and other_rate == first_rate  # key b drafted as if a had not asked
    off = create_app(client, "m", reuse=ReuseLimits(suffix_tokens=0))
    with serve_http(off) as base:
        api = openai.OpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0)
        rates = [api.chat.completions.create(**ask).model_extra["splitllm"]["tokens_per_step"] for _ in range(2)]
    assert rates == [first_rate, first_rate]
