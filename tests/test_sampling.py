"""Sampling: settings, reproducibility by seed, stop rules, and speculative sampling's distribution.

The distribution tests compare empirical counts with the exact distribution (computed from the
model's own logits) by a chi-square goodness-of-fit test. Seeds are fixed, so the p-values are
fixed numbers: the correct rule must pass and a deliberately broken one must fail the same test.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from splitllm.client.local import LocalModel
from splitllm.client.pipeline import LocalMiddle, SplitPipeline
from splitllm.client.session import DECODERS, SplitClient
from splitllm.client.stopping import IncrementalText, StopRule
from splitllm.decoding.sampling import Sampler, SamplingParams
from splitllm.model.stage import Stage
from splitllm.model.weights import ModelFiles
from splitllm.visibility import Visibility

VOCAB = 16
PROMPT = [3, 7, 1, 3, 7, 1, 3, 7]  # repeats, so context lookup proposes from the first step on
PARAMS = SamplingParams(do_sample=True, temperature=0.8, top_k=10, top_p=0.97, repetition_penalty=1.3)
SAMPLES = 2000
PASS_P, FAIL_P = 1e-3, 1e-6


class TopKAcceptance(Sampler):
    """A wrong rule: accept any candidate among the two likeliest tokens."""

    def _accept(self, p: torch.Tensor, candidates: Sequence[int]) -> int:
        top = set(p.topk(2).indices.tolist())
        accepted = [x for x in candidates if x in top]
        return accepted[0] if accepted else super()._accept(p, ())


def _chi_square_p(samples: Sequence[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> float:
    """Goodness of fit of `samples` to `exact`, pooling outcomes expected fewer than 5 times."""
    n, counts = len(samples), Counter(samples)
    assert set(counts) <= set(exact), f"impossible outcomes sampled: {set(counts) - set(exact)}"
    observed, expected, rest_o, rest_e = [], [], 0, 0.0
    for outcome, p in exact.items():
        if p * n >= 5:
            observed.append(counts[outcome])
            expected.append(p * n)
        else:
            rest_o, rest_e = rest_o + counts[outcome], rest_e + p * n
    if rest_e > 0:
        observed.append(rest_o)
        expected.append(rest_e)
    return float(chisquare(observed, expected).pvalue)


def test_sampling_params_are_validated() -> None:
    for bad in (dict(temperature=0.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(repetition_penalty=0)):
        with pytest.raises(ValueError):
            SamplingParams(do_sample=True, **bad)
    SamplingParams(do_sample=False, temperature=0.0)  # greedy ignores the temperature


def test_greedy_takes_the_argmax_after_the_repetition_penalty() -> None:
    logits = torch.tensor([1.0, 3.0, 2.9, -1.0])
    assert Sampler().choose(logits) == 1
    assert Sampler(SamplingParams(repetition_penalty=2.0), history=[1]).choose(logits) == 2


def test_processed_distribution_matches_transformers_warpers() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 3
    probs = Sampler(PARAMS, history=[4, 4, 9]).probs(logits)
    assert probs.dtype == torch.float64 and abs(float(probs.sum()) - 1) < 1e-12
    assert int((probs > 0).sum()) <= PARAMS.top_k
    penalized = logits.clone().double()
    penalized[[4, 9]] = torch.where(penalized[[4, 9]] > 0, penalized[[4, 9]] / 1.3, penalized[[4, 9]] * 1.3)
    kept = probs > 0
    ref = torch.softmax(penalized[kept] / PARAMS.temperature, dim=-1)
    torch.testing.assert_close(probs[kept], ref)


def test_acceptance_rule_reproduces_the_distribution() -> None:
    """One node, many draws: whatever the candidates, the emitted token is distributed as p."""
    logits = torch.tensor([2.0, 1.5, 0.5, 0.0, -0.5, -1.0])
    exact = dict(enumerate(torch.softmax(logits.double(), -1).tolist()))
    params = SamplingParams(do_sample=True, seed=11)
    for candidates in ([0], [1, 0], [5, 2, 3]):
        sampler = Sampler(params)
        draws = [(sampler.choose(logits, candidates),) for _ in range(20000)]
        assert _chi_square_p(draws, {(k,): p for k, p in exact.items()}) > PASS_P
    broken = TopKAcceptance(params)
    draws = [(broken.choose(logits, [1, 0]),) for _ in range(20000)]
    assert _chi_square_p(draws, {(k,): p for k, p in exact.items()}) < FAIL_P


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory: pytest.TempPathFactory) -> tuple[LocalModel, Stage]:
    """A tiny Llama with 16 tokens in float64, split 1 + 1 + 1, peaked enough that candidates are
    accepted often and rejected often."""
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=3, max_position_embeddings=64, initializer_range=0.3, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    folder: Path = tmp_path_factory.mktemp("small-vocab")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    files = ModelFiles(str(folder))
    return LocalModel(files, 1, 1, torch.float64), Stage.load(files, 1, 2, torch.float64)


def _pipeline(model: tuple[LocalModel, Stage]) -> SplitPipeline:
    local, stage = model
    return SplitPipeline(local, LocalMiddle(stage, 32), 32)


def _exact_pairs(model: tuple[LocalModel, Stage]) -> dict[tuple[int, int], float]:
    """P(first two tokens) under PARAMS: one step scores the prompt and every first token as a tree."""
    n = len(PROMPT)
    tokens = torch.tensor(PROMPT + list(range(VOCAB)))
    positions = torch.tensor(list(range(n)) + [n] * VOCAB)
    vis = Visibility.from_parents([*range(-1, n - 1), *[n - 1] * VOCAB])
    logits, _ = _pipeline(model).score(tokens, positions, vis, [])
    first = Sampler(PARAMS, PROMPT).probs(logits[n - 1])
    return {
        (a, b): float(first[a] * q)
        for a in range(VOCAB)
        if first[a] > 0
        for b, q in enumerate(Sampler(PARAMS, PROMPT + [a]).probs(logits[n + a]).tolist())
        if q > 0
    }


def _sample_pairs(model, mode: str, sampler_class: type[Sampler] = Sampler) -> tuple[list[tuple[int, ...]], float]:  # type: ignore[no-untyped-def]
    """SAMPLES two-token continuations of PROMPT (seeds 0..SAMPLES-1) and the mean tokens per step."""
    samples, tokens, steps = [], 0, 0
    for seed in range(SAMPLES):
        sampler = sampler_class(replace(PARAMS, seed=seed), PROMPT)
        out = list(DECODERS[mode]()(_pipeline(model), PROMPT, 2, frozenset(), sampler=sampler))
        ids = [t for o in out for t in o.tokens][:2]
        samples.append(tuple(ids))
        tokens, steps = tokens + len(ids), steps + len(out)
    return samples, tokens / steps


def test_speculative_sampling_keeps_the_distribution(small_vocab) -> None:  # type: ignore[no-untyped-def]
    exact = _exact_pairs(small_vocab)
    assert abs(sum(exact.values()) - 1) < 1e-9
    p_plain = _chi_square_p(_sample_pairs(small_vocab, "sequential")[0], exact)
    spec, per_step = _sample_pairs(small_vocab, "auto")
    p_spec = _chi_square_p(spec, exact)
    broken, _ = _sample_pairs(small_vocab, "auto", TopKAcceptance)
    p_broken = _chi_square_p(broken, exact)
    print(f"chi-square p: plain {p_plain:.3g}, speculative {p_spec:.3g} ({per_step:.2f} tok/step), broken {p_broken:.3g}")
    assert 1.2 < per_step < 2.0  # candidates were accepted often and rejected often
    assert p_plain > PASS_P and p_spec > PASS_P
    assert p_broken < FAIL_P


@pytest.fixture(scope="module")
def default_client() -> SplitClient:
    return SplitClient(None, head=2, tail=2)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sequential", "auto"])
def test_seed_reproduces_samples(default_client: SplitClient, mode: str) -> None:
    params = SamplingParams(do_sample=True, temperature=0.9, top_p=0.95, seed=5)
    first = default_client.generate("Tell me a fact about owls.", 16, mode, sampling=params)
    again = default_client.generate("Tell me a fact about owls.", 16, mode, sampling=params)
    other = default_client.generate("Tell me a fact about owls.", 16, mode, sampling=replace(params, seed=6))
    assert first.ids == again.ids and first.text == again.text
    assert other.ids != first.ids


@pytest.mark.slow
def test_stop_strings_and_eos_end_every_mode_alike(default_client: SplitClient) -> None:
    prompt = "List the numbers from 1 to 12, one per line, as '1. one'."
    results = {
        mode: default_client.generate(prompt, 80, mode, stop=["5."]) for mode in ("sequential", "lookup", "lookahead", "auto")
    }
    ref = results["sequential"]
    assert ref.finish_reason == "stop" and "5." not in ref.text and "4" in ref.text
    assert "5." in default_client.tokenizer.decode(ref.ids)  # the last token completes the stop string
    assert not default_client.tokenizer.decode(ref.ids[:-1]).endswith("5.")
    for mode, gen in results.items():
        assert (gen.ids, gen.text, gen.finish_reason) == (ref.ids, ref.text, ref.finish_reason), mode
    eos = {mode: default_client.generate("Say just: yes", 40, mode) for mode in ("sequential", "lookup", "auto")}
    assert eos["sequential"].finish_reason == "stop" and eos["sequential"].ids[-1] in default_client.stop_ids
    assert all(g.ids == eos["sequential"].ids for g in eos.values())


class _Tokens:
    """A stand-in tokenizer where token i is the i-th string of a table."""

    table = ["a", "b", "<", "/", "s", ">", "c", "</s>"]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.table[i] for i in ids if not (skip_special_tokens and i == 7))


def test_stop_rule_clips_overshooting_steps() -> None:
    def rule() -> StopRule:
        return StopRule(_Tokens(), frozenset({7}), stop=["</s>"], max_new_tokens=6)  # type: ignore[arg-type]

    eos = rule()
    assert eos.clip([0, 1, 7, 0]) == ([0, 1, 7], "stop")  # nothing after EOS
    stop = rule()
    assert stop.clip([0]) == ([0], None) and stop.text() == "a"
    assert stop.clip([1, 2, 3]) == ([1, 2, 3], None) and stop.text() == "ab"  # "</" may grow into "</s>"
    assert stop.clip([4, 5, 0]) == ([4, 5], "stop")  # the token completing the string
    assert stop.text(final=True) == "ab"
    length = rule()
    assert length.clip([0, 1]) == ([0, 1], None)
    assert length.clip([0, 1, 0, 1, 0]) == ([0, 1, 0, 1], "length")
    assert length.text(final=True) == "ababab" and rule().clip([1]) == ([1], None)


def test_incremental_text_equals_decoding_everything(default_files) -> None:  # type: ignore[no-untyped-def]
    """Spaces, punctuation and characters split over several byte tokens (emoji, CJK, accents)."""
    tok = AutoTokenizer.from_pretrained(default_files.path)
    text = "Héllo, wörld! 你好 🙂🚀 — it's   spaced\n\tand tabbed: x=1; <b>tag</b>. " * 3
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    stream = IncrementalText(tok)
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) == stream.text == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)
    rule = StopRule(tok, frozenset(), stop=["🚀"], max_new_tokens=1000)
    kept, reason = rule.clip(ids)
    assert reason == "stop" and rule.text(final=True) == text[: text.index("🚀")]
    assert "🚀" in tok.decode(kept) and "🚀" not in tok.decode(kept[:-1])
