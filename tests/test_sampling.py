"""Sampling: settings, reproducibility by seed, stop rules, and speculative sampling's distribution.

The distribution tests compare empirical counts with the exact distribution (computed from the
model's own logits) by a chi-square goodness-of-fit test. Seeds are fixed, so the p-values are
fixed numbers: the correct rule must pass and a deliberately broken one must fail the same test.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from functools import cache
from pathlib import Path

import llguidance
import pytest
import torch
from conftest import random_drafter
from scipy.stats import chisquare
from transformers import AutoTokenizer

from splitllm.client.client_model import ClientModel
from splitllm.client.pipeline import InProcessMiddle, SplitPipeline
from splitllm.client.client import DECODERS, SplitClient
from splitllm.client.stopping import IncrementalText, StopRule
from splitllm.decoding.grammar import Grammar
from splitllm.decoding.sampling import Sampler, SamplingParams
from splitllm.decoding.tree import ROOT, CandidateTree
from splitllm.decoding.verifier import Graft, verify
from splitllm.drafting.draft_model import DraftModel
from splitllm.model.stage import Stage, Step
from splitllm.weights.sources import ModelFiles
from splitllm.model.visibility import Visibility

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
def small_vocab(vocab16_model: Path) -> tuple[ClientModel, Stage]:
    """The 16-token Llama in float64, split 1 + 1 + 1."""
    files = ModelFiles(str(vocab16_model))
    return ClientModel(files, 1, 1, torch.float64), Stage.load(files, 1, 2, torch.float64)


def _pipeline(model: tuple[ClientModel, Stage]) -> SplitPipeline:
    client_model, stage = model
    return SplitPipeline(client_model, InProcessMiddle(stage, 32), 32)


def _exact_pairs(model: tuple[ClientModel, Stage], params: SamplingParams = PARAMS) -> dict[tuple[int, int], float]:
    """P(first two tokens) under `params`: one step scores the prompt and every first token as a tree."""
    n = len(PROMPT)
    tokens = torch.tensor(PROMPT + list(range(VOCAB)))
    positions = torch.tensor(list(range(n)) + [n] * VOCAB)
    vis = Visibility.from_parents([*range(-1, n - 1), *[n - 1] * VOCAB])
    logits, _ = _pipeline(model).score(Step(tokens, positions, vis))
    first = Sampler(params, PROMPT).probs(logits[n - 1])

    def second(a: int) -> Sampler:
        sampler = Sampler(params, PROMPT + [a])
        if sampler.grammar is not None:
            sampler.grammar.advance(a)
        return sampler

    return {
        (a, b): float(first[a] * q)
        for a in range(VOCAB)
        if first[a] > 0
        for b, q in enumerate(second(a).probs(logits[n + a]).tolist())
        if q > 0
    }


def _sample_pairs(  # type: ignore[no-untyped-def]
    model, mode: str, sampler_class: type[Sampler] = Sampler, tokens: int = 2, params: SamplingParams = PARAMS
) -> tuple[list[tuple[int, ...]], float]:
    """SAMPLES continuations of PROMPT (seeds 0..SAMPLES-1), two tokens long by default, and the mean
    tokens per step."""
    samples, emitted, steps = [], 0, 0
    for seed in range(SAMPLES):
        sampler = sampler_class(replace(params, seed=seed), PROMPT)
        out = list(DECODERS[mode]()(_pipeline(model), PROMPT, tokens, frozenset(), sampler=sampler))
        ids = [t for o in out for t in o.tokens][:tokens]
        samples.append(tuple(ids))
        emitted, steps = emitted + len(ids), steps + len(out)
    return samples, emitted / steps


@pytest.mark.slow  # thousands of sampled continuations
def test_speculative_sampling_keeps_the_distribution(small_vocab) -> None:  # type: ignore[no-untyped-def]
    exact = _exact_pairs(small_vocab)
    assert abs(sum(exact.values()) - 1) < 1e-9
    p_plain = _chi_square_p(_sample_pairs(small_vocab, "sequential")[0], exact)
    spec, per_step = _sample_pairs(small_vocab, "auto")
    p_spec = _chi_square_p(spec, exact)
    broken, _ = _sample_pairs(small_vocab, "auto", TopKAcceptance)
    p_broken = _chi_square_p(broken, exact)
    print(
        f"chi-square p: plain {p_plain:.3g}, speculative {p_spec:.3g} ({per_step:.2f} tok/step), broken {p_broken:.3g}"
    )
    assert 1.2 < per_step < 2.0  # candidates were accepted often and rejected often
    assert p_plain > PASS_P and p_spec > PASS_P
    assert p_broken < FAIL_P


class _Letters:
    """The 16-token models' vocabulary as the letters a-p (p ends), for grammars over them."""

    eos_token_id, bos_token_id, special_token_ids = VOCAB - 1, None, []
    tokens = [bytes([ord("a") + i]) for i in range(VOCAB)]

    def __call__(self, text: bytes) -> list[int]:
        return [b - ord("a") for b in text]


@pytest.mark.slow  # thousands of sampled continuations
def test_speculative_sampling_under_a_grammar_keeps_the_masked_distribution(  # type: ignore[no-untyped-def]
    small_vocab
) -> None:
    """Under a grammar, speculative sampling emits what sequential sampling under it does: the model's
    distribution masked to the grammar, node by node, whatever the drafts were."""
    letters = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Letters()))
    params = replace(PARAMS, grammar=Grammar.lark(letters, "start: /[bdhl][a-h]+/"))
    exact = _exact_pairs(small_vocab, params)
    assert {a for a, _ in exact} <= {1, 3, 7, 11} and {b for _, b in exact} <= set(range(8))
    p_plain = _chi_square_p(_sample_pairs(small_vocab, "sequential", params=params)[0], exact)
    spec, per_step = _sample_pairs(small_vocab, "auto", params=params)
    p_spec = _chi_square_p(spec, exact)
    print(f"chi-square p under a grammar: plain {p_plain:.3g}, speculative {p_spec:.3g} ({per_step:.2f} tok/step)")
    assert per_step > 1.1 and p_plain > PASS_P and p_spec > PASS_P


@pytest.fixture(scope="module")
def default_client() -> SplitClient:
    return SplitClient(None, first=2, last=2)


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
        mode: default_client.generate(prompt, 80, mode, stop=["5."]) for mode in ("sequential", "lookup", "lookahead",
                                                                                  "auto")
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


@pytest.mark.slow
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


class NoRenormalisation(Sampler):
    """A wrong rule: after a rejected sibling, the next one is accepted with its unrenormalised p(x)."""

    def _accept(self, p: torch.Tensor, candidates: Sequence[int]) -> int:
        p = p.clone()
        for x in candidates:
            if float(torch.rand((), generator=self.generator, dtype=torch.float64)) < float(p[x]):
                return int(x)
            p[x] = 0.0
        return int(torch.multinomial(p, 1, generator=self.generator))


TREE_VOCAB = 6
TREE_PARAMS = SamplingParams(do_sample=True, temperature=0.9, top_k=5, seed=0)
TREE_TOKENS = 3


@cache
def _synthetic_logits(prefix: tuple[int, ...]) -> torch.Tensor:
    """Fixed, peaked logits for every prefix: a stand-in model that makes siblings matter."""
    seed = sum((t + 1) * 7**i for i, t in enumerate(prefix))
    return torch.randn(TREE_VOCAB, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 1.5


def _narrow_tree(prefix: tuple[int, ...], widths: tuple[int, ...]) -> CandidateTree:
    """A tree of the likeliest tokens after `prefix`, `widths[d]` children per node at depth d + 1."""
    tree = CandidateTree()
    frontier = [(ROOT, prefix)]
    for width in widths:
        frontier = [
            (tree.add(node, int(t), ("test",)), (*path, int(t)))
            for node, path in frontier
            for t in _synthetic_logits(path).topk(width).indices
        ]
    return tree


@cache
def _synthetic_tree(prefix: tuple[int, ...]) -> CandidateTree:
    """A depth-3 tree, a deterministic function of the prefix: the 3 likeliest tokens first, then 2, then
    3 children per node, likeliest first (so a wrong rule for later siblings shows)."""
    return _narrow_tree(prefix, (3, 2, 3))


def _sample_tree_walks(sampler_class: type[Sampler], samples: int) -> list[tuple[int, ...]]:
    """TREE_TOKENS tokens per sample, drafted by depth-3 trees and verified by `verify` with the rule."""
    drawn = []
    for seed in range(samples):
        sampler, out = sampler_class(replace(TREE_PARAMS, seed=seed)), []
        while len(out) < TREE_TOKENS:
            prefix, tree = tuple(out), _synthetic_tree(tuple(out))

            def choose(
                node: int, candidates: list[int], prefix: tuple[int, ...] = prefix, tree: CandidateTree = tree,
                sampler: Sampler = sampler,
            ) -> int:
                path = prefix + tuple(tree.tokens[i] for i in _ancestry(tree, node))
                return sampler.choose(_synthetic_logits(path), candidates)

            out += verify(tree, choose, TREE_TOKENS - len(out), frozenset()).tokens
        drawn.append(tuple(out))
    return drawn


def _ancestry(tree: CandidateTree, node: int) -> list[int]:
    path = []
    while node != ROOT:
        path.append(node)
        node = tree.parents[node]
    return path[::-1]


def _exact_synthetic() -> dict[tuple[int, ...], float]:
    """P(first TREE_TOKENS tokens) under TREE_PARAMS and the stand-in model."""
    probs = lambda path: Sampler(TREE_PARAMS).probs(_synthetic_logits(path)).tolist()  # noqa: E731
    return {
        (a, b, c): pa * pb * pc
        for a, pa in enumerate(probs(()))
        for b, pb in enumerate(probs((a,)))
        for c, pc in enumerate(probs((a, b)))
        if pa * pb * pc > 0
    }


def test_tree_acceptance_is_exact_at_depth_three_with_siblings() -> None:
    """Depth-3 trees with 2-3 siblings per level: the walk's tokens are distributed exactly as plain
    sampling; a rule that forgets to renormalise after a rejected sibling fails the same test."""
    exact = _exact_synthetic()
    depths = [len(_ancestry(_synthetic_tree(()), i)) for i in range(len(_synthetic_tree(())))]
    assert max(depths) == 3 and len(_synthetic_tree(())) == 3 + 6 + 18
    p_right = _chi_square_p(_sample_tree_walks(Sampler, 3000), exact)
    p_wrong = _chi_square_p(_sample_tree_walks(NoRenormalisation, 3000), exact)
    print(f"chi-square p: right rule {p_right:.3g}, no renormalisation {p_wrong:.3g}")
    assert p_right > PASS_P
    assert p_wrong < FAIL_P


def _exact_triples(model: tuple[ClientModel, Stage]) -> dict[tuple[int, ...], float]:
    """P(first three tokens) under PARAMS: one step scores the prompt and every one- and two-token
    continuation as a tree."""
    n, firsts = len(PROMPT), list(range(VOCAB))
    pairs = [(a, b) for a in firsts for b in firsts]
    tokens = torch.tensor(PROMPT + firsts + [b for _, b in pairs])
    positions = torch.tensor(list(range(n)) + [n] * VOCAB + [n + 1] * len(pairs))
    vis = Visibility.from_parents([*range(-1, n - 1), *[n - 1] * VOCAB, *(n + a for a, _ in pairs)])
    client_model, stage = model
    logits, _ = SplitPipeline(client_model, InProcessMiddle(stage, 300), 300).score(Step(tokens, positions, vis))
    probs = lambda prefix, row: Sampler(PARAMS, PROMPT + prefix).probs(logits[row]).tolist()  # noqa: E731
    exact = {}
    for a, pa in enumerate(probs([], n - 1)):
        for b, pb in enumerate(probs([a], n + a) if pa > 0 else []):
            for c, pc in enumerate(probs([a, b], n + VOCAB + a * VOCAB + b) if pb > 0 else []):
                if pc > 0:
                    exact[(a, b, c)] = pa * pb * pc
    return exact


@pytest.mark.slow  # thousands of sampled continuations
@pytest.mark.parametrize("drafter", ["drafter", "draft model"])
def test_drafter_sampling_keeps_the_distribution(small_vocab, vocab16_draft_model: Path,  # type: ignore[no-untyped-def]
                                                 drafter: str) -> None:
    """Three tokens: the prefill, then a step whose tree holds the drafter's top-k siblings (random
    weights: a learned drafter's, or a whole draft model's), point masses like any candidate."""
    client_model, stage = small_vocab
    drafting = ClientModel(client_model.files, 1, 1, torch.float64)
    if drafter == "drafter":
        drafting.drafter = random_drafter(client_model.files, torch.float64)
    else:
        drafting.draft_model = DraftModel(ModelFiles(str(vocab16_draft_model)), torch.float64)
    exact = _exact_triples(small_vocab)
    assert abs(sum(exact.values()) - 1) < 1e-9
    spec, per_step = _sample_pairs((drafting, stage), "drafter", tokens=3)
    p_spec = _chi_square_p(spec, exact)
    print(f"chi-square p: draft {p_spec:.3g} ({per_step:.2f} tok/step)")
    assert per_step > 1.2
    assert p_spec > PASS_P


def _sample_walks_with_a_step_ahead(samples: int) -> tuple[list[tuple[int, ...]], int]:
    """TREE_TOKENS tokens per sample: a one-path tree in flight, and a step sent ahead on its first node
    whose first level holds the next likeliest tokens the tree lacks there, each with two children;
    a handoff goes on in the step ahead from its entry node. Also how many walks were handed off."""
    drawn, handed = [], 0
    for seed in range(samples):
        sampler, out = Sampler(replace(TREE_PARAMS, seed=seed)), []
        while len(out) < TREE_TOKENS:
            prefix, tree = tuple(out), _narrow_tree(tuple(out), (1, 1))
            graft = tree.child_tokens(ROOT)[0]
            after = (*prefix, graft)
            lacked = [int(t) for t in _synthetic_logits(after).topk(4).indices if tree.child(0, int(t)) is None][:3]
            ahead = CandidateTree()
            for t in lacked:
                entry = ahead.add(ROOT, t, ("ahead",))
                for u in _synthetic_logits((*after, t)).topk(2).indices:
                    ahead.add(entry, int(u), ("ahead",))

            def choose_in(tree: CandidateTree, base: tuple[int, ...],  # type: ignore[no-untyped-def]
                          sampler: Sampler = sampler):
                return lambda node, candidates: sampler.choose(
                    _synthetic_logits(base + tuple(tree.tokens[i] for i in _ancestry(tree, node))), candidates
                )

            verdict = verify(tree, choose_in(tree, prefix), TREE_TOKENS - len(out), frozenset(),
                             graft=Graft(0, tuple(lacked)))
            out += verdict.tokens
            if verdict.handoff:
                handed += 1
                entry = ahead.child(ROOT, verdict.tokens[-1])
                assert entry is not None
                out += verify(ahead, choose_in(ahead, after), TREE_TOKENS - len(out), frozenset(), start=entry).tokens
        drawn.append(tuple(out))
    return drawn, handed


def test_a_step_sent_ahead_keeps_sampling_exact() -> None:
    """The graft's first level is offered once beside the tree's own children, and the walk goes on in
    the step sent ahead from the token chosen: the tokens are distributed exactly as plain sampling."""
    exact = _exact_synthetic()
    walks, handed = _sample_walks_with_a_step_ahead(3000)
    p_ahead = _chi_square_p(walks, exact)
    print(f"chi-square p: with a step ahead {p_ahead:.3g} ({handed} handed off)")
    assert handed > 300
    assert p_ahead > PASS_P
