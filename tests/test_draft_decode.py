"""Drafting with the drafter: the proposer's cache bookkeeping, exactness of the modes that use it,
and steps that shrink to the room left near the end of the context.

A random head drafts noise over a 16-token vocabulary, so its top-k children are often right by
chance: head nodes get accepted and rejected at every depth, which is what exactness must survive.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import random_head

from splitllm.client.local import LocalModel
from splitllm.client.pipeline import LocalMiddle, SplitPipeline
from splitllm.client.remote import RemoteMiddle
from splitllm.decoding.budget import NodeCost, SpecBudget
from splitllm.decoding.gate import DraftGate, GateConfig
from splitllm.decoding.speculation_config import Mode, SpeculationConfig
from splitllm.decoding.policy import StaticPolicy
from splitllm.decoding.proposers.drafter import DrafterProposer
from splitllm.decoding.sequential import decode_sequential
from splitllm.decoding.speculative import SpeculativeDecoder
from splitllm.model.stage import Stage
from splitllm.model.weights import ModelFiles
from splitllm.visibility import Visibility

VOCAB = 16
CONTEXT = 64
BIG = SpecBudget(max_nodes=40, window=4, levels=3, guesses=3, depth=8)


@pytest.fixture(scope="module")
def model(vocab16_model: Path) -> tuple[LocalModel, Stage]:
    """The 16-token Llama in float64 split 1 + 1 + 1, with a random drafter."""
    files = ModelFiles(str(vocab16_model))
    local = LocalModel(files, 1, 1, torch.float64)
    local.drafter = random_head(files, torch.float64)
    return local, Stage.load(files, 1, 2, torch.float64)


def _pipeline(model: tuple[LocalModel, Stage], context: int = CONTEXT) -> SplitPipeline:
    local, stage = model
    return SplitPipeline(local, LocalMiddle(stage, context), context)


def _ids(decoder, pipeline: SplitPipeline, prompt: list[int], n: int) -> tuple[list[int], list]:  # type: ignore[no-untyped-def]
    outs = list(decoder(pipeline, prompt, n, frozenset()))
    return [t for o in outs for t in o.tokens], outs


@pytest.fixture(scope="module")
def fused_model(vocab16_model: Path) -> tuple[LocalModel, Stage]:
    """The same split with a random fused drafter: it reads the head's and the middle's outputs too."""
    files = ModelFiles(str(vocab16_model))
    local = LocalModel(files, 1, 1, torch.float64)
    local.drafter = random_head(files, torch.float64, taps=(1, 2))
    return local, Stage.load(files, 1, 2, torch.float64)


@pytest.mark.parametrize("mode", ["draft", "auto"])
@pytest.mark.parametrize("fused", [False, True])
def test_draft_modes_match_sequential(model, fused_model, mode: str, fused: bool) -> None:  # type: ignore[no-untyped-def]
    model = fused_model if fused else model
    accepted_from_head = 0
    for seed in range(4):
        prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        expected, _ = _ids(decode_sequential, _pipeline(model), prompt, 40)
        ids, outs = _ids(SpeculativeDecoder(SpeculationConfig(mode, drafter_policy=StaticPolicy(BIG))), _pipeline(model), prompt, 40)
        assert ids == expected, seed
        accepted_from_head += sum(n for o in outs for src, n in o.stats.sources.items() if "draft" in src)
        assert all(o.stats.draft_ms > 0 for o in outs[1:])
    assert accepted_from_head > 10  # the head's nodes were accepted (and so its cache kept in step)


def test_the_gate_learns_from_what_each_step_yielded(model, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The gate weighs the tokens a step yielded (and the head's share of them): it must see them filled in."""
    seen: list[int] = []
    observe = DraftGate.observe

    def spy(gate: DraftGate, stats, drafted: bool) -> None:  # type: ignore[no-untyped-def]
        seen.append(stats.accepted)
        observe(gate, stats, drafted)

    monkeypatch.setattr(DraftGate, "observe", spy)
    prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(0)).tolist()
    _ids(SpeculativeDecoder(SpeculationConfig(Mode.AUTO, drafter_policy=StaticPolicy(BIG))), _pipeline(model), prompt, 40)
    assert seen and min(seen) >= 1 and max(seen) > 1


def test_the_gate_tries_drafting_less_often_while_it_does_not_pay() -> None:
    """Each try that finds drafting still not paying doubles the wait for the next (up to max_explore);
    once it pays, every step drafts and the wait starts over."""
    gate = DraftGate(GateConfig(explore=8, max_explore=32))
    cost = NodeCost(step_ms=10.0, node_ms=1.0)
    gate.ms = 50.0  # drafting costs more than the tokens it gains are worth
    assert [step for step in range(200) if gate.worth(cost, step)] == [0, 8, 24, 56, 88, 120, 152, 184]
    gate.ms = 0.0
    assert all(gate.worth(cost, step) for step in range(200, 210))
    gate.ms = 50.0
    assert [step for step in range(210, 260) if gate.worth(cost, step)] == [216, 224, 240]


def test_draft_mode_needs_a_head(tiny_models, local_model) -> None:  # type: ignore[no-untyped-def]
    local = local_model(tiny_models["llama"], 1, 1)
    pipeline = SplitPipeline(local, LocalMiddle(Stage.load(local.files, 1, 3, torch.float32), 32), 32)
    with pytest.raises(ValueError, match="needs a drafter"):
        next(SpeculativeDecoder(SpeculationConfig(Mode.DRAFT))(pipeline, [1, 2, 3], 4, frozenset()))


def test_head_cache_follows_the_committed_sequence(model) -> None:  # type: ignore[no-untyped-def]
    """Fed step by step (features of each step's committed nodes, trees grown in between, some steps
    not drafting), the head's cache holds exactly what one sync of the whole sequence computes, and drafts the same tree given
    the same calibration (what the stepped proposer learned from the tokens it saw)."""
    local, _ = model
    ids = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(9)).tolist()
    features, _ = _pipeline(model).forward(torch.tensor(ids[:-1]), torch.arange(29), Visibility.chain(29), [])
    budget, idle = SpecBudget(max_nodes=30, depth=5), SpecBudget(max_nodes=0, depth=5)
    stepped = DrafterProposer(local.drafter, local, CONTEXT)
    start = 0
    for end in (7, 8, 11, 12, 13, 18, 25, 29):
        stepped.observe(start, features[start:end])
        drafting = end in (8, 13, 29)  # steps that do not draft leave their positions for the next that does
        drafts = stepped.propose(ids[: end + 1], budget if drafting else idle)
        assert drafting == bool(drafts) and stepped.committed == (end if drafting else stepped.committed)
        start = end
    whole = DrafterProposer(local.drafter, local, CONTEXT)
    whole.observe(0, features)
    whole.calibration = stepped.calibration
    assert whole.propose(ids, budget) == drafts and len(drafts) > 20
    assert stepped.committed == whole.committed == 29
    for a, b in ((stepped.cache.k, whole.cache.k), (stepped.cache.v, whole.cache.v)):
        torch.testing.assert_close(a[..., :29, :], b[..., :29, :], rtol=0, atol=1e-10)


@pytest.mark.parametrize("mode", ["lookahead", "auto", "draft"])
def test_steps_shrink_to_the_context_left(model, mode: str) -> None:  # type: ignore[no-untyped-def]
    """A prompt that leaves room for just the new tokens: trees and windows shrink to fit, positions
    stay below the model's maximum (CONTEXT here), and the output is sequential's."""
    prompt = [3, 4, 5, 6] * 12 + [3, 4]  # repetitive, so every source has drafts to offer
    for context, n in ((60, 11), (CONTEXT + 8, 15)):  # the caches' room runs out, then the model's positions
        assert len(prompt) + n - 1 == min(context, CONTEXT)  # the last token is never fed
        expected, _ = _ids(decode_sequential, _pipeline(model, context), prompt, n)
        decoder = SpeculativeDecoder(SpeculationConfig(mode, StaticPolicy(BIG), drafter_policy=StaticPolicy(BIG)))
        ids, outs = _ids(decoder, _pipeline(model, context), prompt, n)
        assert ids == expected
        assert len(outs) < n  # still speculating until the very end


def test_steps_shrink_to_what_the_server_grants(tiny_models, server) -> None:  # type: ignore[no-untyped-def]
    """The server grants a shorter context than asked: the client sizes its steps to it."""
    folder = tiny_models["llama"]
    local = LocalModel(ModelFiles(folder), 1, 1)
    url = server(folder, 1, 1, max_context=40).url
    prompt = [7, 8, 9, 10] * 7

    def run(decoder) -> list[int]:  # type: ignore[no-untyped-def]
        middle = RemoteMiddle(url, local.files.fingerprint, local.middle_range, "float32", 96)
        try:
            return _ids(decoder, SplitPipeline(local, middle, 96), prompt, 12)[0]
        finally:
            middle.close()

    assert run(SpeculativeDecoder(SpeculationConfig(Mode.LOOKAHEAD, StaticPolicy(BIG)))) == run(decode_sequential)
