"""Split greedy decoding through a real server on loopback (float32 compute and wire) produces exactly
the tokens of transformers' `generate(do_sample=False)` on the unsplit model."""

from __future__ import annotations

import pytest
import torch

from splitllm.client.client import SplitClient
from splitllm.model.precision import EXACT

NEW_TOKENS = 64
# (first, last, prompts run): every prompt at the servers' default split, the first three at the others (a
# layer boundary out of place shows on any prompt; each prompt at each split is 4-5 s of the suite).
DEFAULT_SPLITS = [(2, 2, 8), (1, 1, 3), (4, 4, 3), (8, 0, 3)]
# Open-ended requests, so most answers run the whole budget instead of ending early at EOS.
DEFAULT_PROMPTS = [
    "Write a detailed essay about the history of the printing press.",
    "Explain step by step how a refrigerator keeps food cold.",
    "List twenty animals that live in the ocean, with one fact about each.",
    "Write a Python function that checks whether a number is prime, then explain it line by line.",
    "Tell me a long story about a dragon who learns to bake bread.",
    "What are the main causes of climate change? Answer in detail.",
    "Describe the water cycle for a ten-year-old, in several paragraphs.",
    "Compare cats and dogs as pets: temperament, cost, care and lifespan.",
]
TINY_SPLITS = {  # the first split of each family runs in the fast tier, the others are slow
    "llama": [(1, 2)],
    "qwen2": [(1, 1), (2, 0)],
    "mistral": [(1, 1), (2, 3), (4, 0)],
    "gemma3": [(1, 1), (2, 3)],
}


@pytest.fixture(scope="module")
def default_prompts() -> list[list[int]]:
    """The prompts as the client encodes them (chat template)."""
    client = SplitClient(None, None, 1, 1, precision=EXACT)
    return [client.encode_prompt(p) for p in DEFAULT_PROMPTS]


@pytest.fixture(scope="module")
def default_reference(default_prompts, hf_greedy) -> list[list[int]]:
    refs = [hf_greedy(None, ids, NEW_TOKENS) for ids in default_prompts]
    assert sum(len(r) == NEW_TOKENS for r in refs) >= 6, "prompts should mostly run the whole budget"
    return refs


@pytest.mark.slow
@pytest.mark.parametrize(("first", "last", "prompts"), DEFAULT_SPLITS)
def test_default_model_split_greedy_equals_transformers(first, last, prompts, server, default_prompts,
                                                        default_reference):
    url = server(None, first, last, dtype=torch.float32).url
    client = SplitClient(None, url, first, last, wire_dtype="float32", max_context=256, precision=EXACT)
    for i, (ids, ref) in enumerate(zip(default_prompts[:prompts], default_reference)):
        gen = client.generate(ids, NEW_TOKENS, decode="sequential")
        assert gen.ids == ref, f"prompt {i}: split {first}+{last} diverges at token {_first_difference(gen.ids, ref)}"


@pytest.mark.parametrize(("name", "first", "last"), [
    pytest.param(n, h, t, marks=[pytest.mark.slow] if i else [])
    for n, splits in TINY_SPLITS.items() for i, (h, t) in enumerate(splits)
])
def test_tiny_model_split_greedy_equals_transformers(
    name, first, last, tiny_models, server, load_client_model, split_greedy, hf_greedy, random_ids
):
    folder = tiny_models[name]
    url = server(folder, first, last, dtype=torch.float32).url
    client_model = load_client_model(folder, first, last)
    for seed, length in enumerate([1, 3, 5, 8, 9, 13, 21, 30]):  # around and past the 8-token windows
        prompt = random_ids(length, seed=100 + seed)
        ref = hf_greedy(folder, prompt, NEW_TOKENS)
        assert len(ref) == NEW_TOKENS
        got = split_greedy(client_model, url, prompt, NEW_TOKENS)
        assert got == ref, f"prompt {seed} diverges at token {_first_difference(got, ref)}"


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
