"""Gemma 3 270M, the second packaged model, through the split: in float32, greedy decoding identical to
transformers in-process and through a real server on loopback; in the fastest setting here, lookup
speculation and JSON under a schema commit sequential decoding's tokens.

Its pattern of five sliding-window layers (window 512) to one full-attention layer puts both kinds on
each side of every split tested here; the tiny random Gemma 3 in conftest covers windows smaller than
the prompts."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from splitllm.lab.bench.exactness import first_difference
from splitllm.client.client import SplitClient
from splitllm.model.precision import EXACT
from splitllm.weights.sources import ModelFiles
from splitllm.model.stage import Step
from splitllm.model.visibility import Visibility

pytestmark = pytest.mark.slow

MODEL = "gemma3"
NEW_TOKENS = 24
# A base model (no chat template): plain continuations that run the whole budget.
PROMPTS = [
    "The history of the printing press begins in",
    "def is_prime(n):",
    "Here is a list of animals that live in the ocean:",
]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(ModelFiles(MODEL).path)
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(prompts, hf_greedy) -> list[list[int]]:  # type: ignore[no-untyped-def]
    refs = [hf_greedy(MODEL, ids, NEW_TOKENS) for ids in prompts]
    assert all(len(r) == NEW_TOKENS for r in refs)
    return refs


@pytest.fixture(scope="module")
def client():  # type: ignore[no-untyped-def]
    return SplitClient(MODEL, None, 2, 2, max_context=256, precision=EXACT)


@pytest.fixture(scope="module")
def fast_client():  # type: ignore[no-untyped-def]
    """The fastest setting here: where splitllm's kernels run, speculation reproduces sequential decoding."""
    return SplitClient(MODEL, None, 2, 2, max_context=256)


def test_gemma3_config() -> None:
    cfg = ModelFiles(MODEL).config
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == ("gemma3_text", 18, 640, 262144)
    assert cfg.layer_windows == ((512,) * 5 + (None,)) * 3
    sliding, full = cfg.layer_ropes[0], cfg.layer_ropes[5]
    assert sliding.inv_freq[1] > full.inv_freq[1]  # rope bases 10k (local) and 1M (global)
    assert cfg.tie_word_embeddings and cfg.embed_scale == 640**0.5 and cfg.attn_scale == 256**-0.5


def test_gemma3_logits_match_transformers_past_the_sliding_window(pipeline,  # type: ignore[no-untyped-def]
                                                                  hf_model) -> None:
    """A 700-token prompt: the last positions see their window of 512 in local layers, everything in global ones."""
    tokenizer = AutoTokenizer.from_pretrained(ModelFiles(MODEL).path)
    text = " ".join(f"Item {i}: the {i % 7}th colour of the {i % 11}th wheel." for i in range(80))
    tokens = tokenizer(text)["input_ids"][:700]
    n = len(tokens)
    assert n == 700
    last = torch.arange(n - 4, n)
    ours, _ = pipeline(MODEL, 2, 2,
                       max_context=n).score(Step(torch.tensor(tokens), torch.arange(n), Visibility.chain(n)), rows=last)
    with torch.no_grad():
        ref = hf_model(MODEL)(torch.tensor([tokens]), logits_to_keep=4).logits[0]
    assert (ours - ref).abs().max().item() < 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_gemma3_split_greedy_equals_transformers_in_process(client, prompts,  # type: ignore[no-untyped-def]
                                                            reference) -> None:
    for i, (ids, ref) in enumerate(zip(prompts, reference)):
        got = client.generate(ids, NEW_TOKENS).ids
        assert got == ref, f"prompt {i} diverges at token {first_difference(got, ref)}"


def test_gemma3_split_greedy_equals_transformers_over_loopback(
    prompts, reference, server, load_client_model, split_greedy
) -> None:  # type: ignore[no-untyped-def]
    first, last = 6, 1  # the client holds a full-attention layer (5) and the server a sliding one first
    url = server(MODEL, first, last, dtype=torch.float32).url
    client_model = load_client_model(MODEL, first, last)
    for i, (ids, ref) in enumerate(zip(prompts, reference)):
        got = split_greedy(client_model, url, ids, NEW_TOKENS)
        assert got == ref, f"prompt {i} diverges at token {first_difference(got, ref)}"


def test_gemma3_lookup_speculation_commits_the_same_tokens(fast_client,  # type: ignore[no-untyped-def]
                                                           prompts) -> None:
    """Lookup drafting from the prompt's own n-grams: trees of several nodes, verified row by row."""
    if not fast_client.client_model.row_invariant:
        pytest.skip("no splitllm kernel variant runs on this CPU: speculation is refused (test_precision.py)")
    drafted = 0
    for i, ids in enumerate(prompts):
        ref = fast_client.generate(ids, NEW_TOKENS, decode="sequential").ids
        gen = fast_client.generate(ids, NEW_TOKENS, decode="lookup")
        assert gen.ids == ref, f"prompt {i} diverges at token {first_difference(gen.ids, ref)}"
        drafted += sum(s.speculation.drafted for s in gen.steps)
    assert drafted > 0


def test_gemma3_base_model_refuses_chat_turns(client) -> None:  # type: ignore[no-untyped-def]
    with client.conversation() as conv, pytest.raises(ValueError, match="no chat template"):
        next(conv.say("Hello"))


def test_gemma3_json_under_a_schema_is_valid_and_speculation_changes_nothing(  # type: ignore[no-untyped-def]
    fast_client
) -> None:
    """A model with no chat template still answers in JSON under a schema (its vocabulary is 262k tokens)."""
    import json

    from splitllm.decoding.grammar import Grammar, grammar_tokenizer
    from splitllm.decoding.sampling import SamplingParams

    client = fast_client
    vocab = grammar_tokenizer(client.tokenizer, client.files.hf_config.vocab_size, client.stop_ids)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                               "year": {"type": "integer", "minimum": 0, "maximum": 3000}},
              "required": ["city", "year"], "additionalProperties": False}
    sampling = SamplingParams(grammar=Grammar.json_schema(vocab, schema))
    texts = [client.generate("The capital of France, as JSON:", 48, decode, chat=False, sampling=sampling).text
             for decode in ("sequential", "auto")]
    assert texts[0] == texts[1]
    assert set(json.loads(texts[0])) == {"city", "year"}
