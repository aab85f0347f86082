"""Speculative decoding commits exactly what sequential greedy decoding commits, and leaves every cache
(client first and last stages, server middle) as a from-scratch computation of the committed tokens would.

Property tests run tiny random models in float64, where logits do not depend on the batch beyond
~1e-15, so any difference is a bug; candidates come from a scripted proposer that knows the greedy
continuation and corrupts it at random, so every accept/reject pattern and cache compaction occurs.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
from conftest import random_drafter
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitllm.client.client_model import ClientModel
from splitllm.client.pipeline import InProcessMiddle, SplitPipeline
from splitllm.client.remote import RemoteMiddle
from splitllm.decoding.sizing.budget import SpecBudget
from splitllm.decoding.speculation_config import SPECULATIVE_MODES, SpeculationConfig
from splitllm.decoding.sizing.policies import StaticPolicy
from splitllm.decoding.proposers import Candidate, Proposer
from splitllm.decoding.proposers.lookahead import LookaheadWindow
from splitllm.decoding.proposers.lookup import ContextLookup
from splitllm.decoding.sequential import decode_sequential
from splitllm.decoding.speculative import SpeculativeDecoder
from splitllm.model.stage import Stage, Step
from splitllm.weights.sources import ModelFiles
from splitllm.model.visibility import Visibility

VOCAB = 512
CONTEXT = 96


@pytest.fixture(autouse=True, scope="module")
def one_thread():  # type: ignore[no-untyped-def]
    """Tiny matrices: a second OpenMP thread only adds contention (30x slower on a loaded 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@dataclass
class Float64Model:
    client_model: ClientModel
    middle: Stage

    def pipeline(self) -> SplitPipeline:
        return SplitPipeline(self.client_model, InProcessMiddle(self.middle, CONTEXT), CONTEXT)


@pytest.fixture(scope="module")
def f64(tiny_models) -> dict[str, Float64Model]:  # type: ignore[no-untyped-def]
    models = {}
    for name in ("llama", "mistral"):  # mistral: sliding window 8, so trees cross window edges
        files = ModelFiles(tiny_models[name])
        end = files.config.num_layers - 1
        client_model = ClientModel(files, 1, 1, torch.float64)
        client_model.drafter = random_drafter(files, torch.float64)  # `drafter` and `auto` draft with it too
        models[name] = Float64Model(client_model, Stage.load(files, 1, end, torch.float64))
    return models


class Scripted:
    """Drafts cut from the true greedy continuation at random points and then garbled: some
    accepted in full, some in part, some not at all."""

    name = "scripted"

    def __init__(self, truth: Sequence[int], seed: int) -> None:
        self.truth, self.rng = truth, random.Random(seed)

    def propose(self, history: Sequence[int], budget: SpecBudget) -> list[Candidate]:
        true = list(self.truth[len(history) : len(history) + budget.depth])
        candidates = []
        for _ in range(budget.guesses):
            keep = self.rng.randint(0, len(true))
            noise = [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(0, 3))]
            tokens = tuple(true[:keep] + noise)
            if tokens:
                candidates.append(Candidate(tokens, self.name, self.rng.uniform(0.05, 1.0)))
        return candidates


def sequential(model: Float64Model, prompt: list[int], n: int, stop_ids: frozenset[int]) -> list[int]:
    return [t for out in decode_sequential(model.pipeline(), prompt, n, stop_ids) for t in out.tokens]


def assert_caches_match_recomputation(
    model: Float64Model, pipeline: SplitPipeline, path: list[int], ids: list[int]
) -> None:
    """Commit the last step's path everywhere (what the next step's keep does), then compare with a fresh prefill."""
    assert isinstance(pipeline.middle, InProcessMiddle)
    caches = [pipeline.caches.first, pipeline.caches.last, pipeline.middle.cache]
    for cache in caches:
        cache.keep(path)
    length = len(ids) - 1  # the last committed token is never fed
    fresh = model.pipeline()
    fresh.forward(Step(torch.tensor(ids[:-1]), torch.arange(length), Visibility.chain(length)))
    assert isinstance(fresh.middle, InProcessMiddle)
    for cache, ref in zip(caches, [fresh.caches.first, fresh.caches.last, fresh.middle.cache]):
        ref.keep(list(range(length)))
        assert cache.length == ref.length == length
        assert torch.equal(cache.positions[:length], torch.arange(length))
        torch.testing.assert_close(cache.k[:, :, :, :length], ref.k[:, :, :, :length], rtol=0, atol=1e-10)
        torch.testing.assert_close(cache.v[:, :, :, :length], ref.v[:, :, :, :length], rtol=0, atol=1e-10)


budgets = st.builds(
    SpecBudget,
    max_nodes=st.integers(0, 12),
    window=st.sampled_from([0, 0, 2, 3, 4]),
    levels=st.integers(2, 3),
    guesses=st.integers(0, 4),
    depth=st.integers(1, 6),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.sampled_from(["llama", "mistral"]),
    prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
    max_new_tokens=st.integers(1, 24),
    budget=budgets,
    seed=st.integers(0, 2**16),
    with_lookup=st.booleans(),
    stop_at=st.none() | st.integers(0, 23),
)
def test_speculative_equals_sequential_and_caches_match(
    f64, name, prompt, max_new_tokens, budget, seed, with_lookup, stop_at  # type: ignore[no-untyped-def]
) -> None:
    model = f64[name]
    truth = prompt + sequential(model, prompt, max_new_tokens + budget.depth, frozenset())
    stop_ids = frozenset() if stop_at is None else frozenset([truth[len(prompt) + min(stop_at, max_new_tokens - 1)]])
    expected = sequential(model, prompt, max_new_tokens, stop_ids)

    def proposers() -> list[Proposer]:
        found: list[Proposer] = [Scripted(truth, seed), LookaheadWindow(seed=seed)]
        return found + [ContextLookup()] if with_lookup else found

    config = SpeculationConfig(policy=StaticPolicy(budget), drafter_policy=StaticPolicy(budget), proposers=proposers)
    decoder = SpeculativeDecoder(config)
    pipeline = model.pipeline()
    outs = list(decoder(pipeline, prompt, max_new_tokens, stop_ids))
    ids = [t for out in outs for t in out.tokens]
    assert ids == expected
    for i, out in enumerate(outs):
        fed = len(prompt) if i == 0 else 1  # the prompt, then each step's bonus token from the step before
        spec = out.stats.speculation
        assert out.stats.timing.nodes == fed + spec.drafted + spec.window
        assert len(out.tokens) == len(out.path) - fed + 1
    assert_caches_match_recomputation(model, pipeline, outs[-1].path, prompt + ids)


@pytest.mark.parametrize("mode", list(SPECULATIVE_MODES))
def test_modes_match_sequential_on_a_repetitive_prompt(f64, mode: str) -> None:  # type: ignore[no-untyped-def]
    """The real proposers on a prompt that repeats, so lookups and pool n-grams get accepted."""
    model = f64["llama"]
    prompt = [7, 8, 9, 10, 11] * 4 + [7, 8]
    expected = sequential(model, prompt, 40, frozenset())
    pipeline = model.pipeline()
    outs = list(SpeculativeDecoder(SpeculationConfig(mode))(pipeline, prompt, 40, frozenset()))
    assert [t for out in outs for t in out.tokens] == expected
    assert_caches_match_recomputation(model, pipeline, outs[-1].path, prompt + expected)


def test_speculation_over_a_server_matches_sequential(tiny_models, server) -> None:  # type: ignore[no-untyped-def]
    """Over a real socket (float32 on the wire, float64 in compute): trees and windows travel and compact there too."""
    folder = tiny_models["qwen2"]
    client_model = ClientModel(ModelFiles(folder), 1, 1, torch.float64)
    client_model.drafter = random_drafter(client_model.files, torch.float64)
    url = server(folder, 1, 1, dtype=torch.float64).url
    prompt = [3, 4, 5, 6] * 5

    def run(decoder) -> tuple[list[int], int]:  # type: ignore[no-untyped-def]
        middle = RemoteMiddle(url, client_model.files.fingerprint, client_model.middle_range, "float32", CONTEXT)
        try:
            outs = list(decoder(SplitPipeline(client_model, middle, CONTEXT), prompt, 48, frozenset()))
        finally:
            middle.close()
        return [t for out in outs for t in out.tokens], len(outs)

    expected, _ = run(decode_sequential)
    for mode in SPECULATIVE_MODES:
        ids, steps = run(SpeculativeDecoder(SpeculationConfig(mode)))
        assert ids == expected, mode
    assert steps <= len(expected)
