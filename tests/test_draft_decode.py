"""Drafting with the drafter: the proposer's cache bookkeeping, exactness of the modes that use it,
and steps that shrink to the room left near the end of the context.

A random drafter drafts noise over a 16-token vocabulary, so its top-k children are often right by
chance: its nodes get accepted and rejected at every depth, which is what exactness must survive.
A second random 16-token model drafts the same way as a whole draft model.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import Distant, random_drafter

from splitllm.client.client_model import ClientModel
from splitllm.client.pipeline import InProcessMiddle, SplitPipeline
from splitllm.client.remote import RemoteMiddle
from splitllm.decoding.sizing.budget import NodeCost, SpecBudget
from splitllm.decoding.sizing.gate import AheadGate, DraftGate, GateConfig
from splitllm.decoding.mode_names import Mode
from splitllm.decoding.speculation_config import SpeculationConfig, TreeShape
from splitllm.decoding.sizing.policies import StaticPolicy
from splitllm.drafting import draft_model_proposer
from splitllm.drafting.draft_model_proposer import DraftModelProposer
from splitllm.drafting.drafter_proposer import DrafterProposer
from splitllm.decoding.sampling import Sampler
from splitllm.decoding.sequential import decode_sequential
from splitllm.decoding.speculative import SpeculativeDecoder
from splitllm.kernels import cpu_kernels
from splitllm.drafting.draft_model import DraftModel, drafting_precision
from splitllm.model.precision import Precision
from splitllm.model.stage import Stage, Step
from splitllm.weights.sources import ModelFiles
from splitllm.model.visibility import Visibility

VOCAB = 16
CONTEXT = 64
BIG = SpecBudget(max_nodes=40, window=4, levels=3, guesses=3, depth=8)


@pytest.fixture(scope="module")
def model(vocab16_model: Path) -> tuple[ClientModel, Stage]:
    """The 16-token Llama in float64 split 1 + 1 + 1, with a random drafter."""
    files = ModelFiles(str(vocab16_model))
    client_model = ClientModel(files, 1, 1, torch.float64)
    client_model.drafter = random_drafter(files, torch.float64)
    return client_model, Stage.load(files, 1, 2, torch.float64)


def _pipeline(model: tuple[ClientModel, Stage], context: int = CONTEXT) -> SplitPipeline:
    client_model, stage = model
    return SplitPipeline(client_model, InProcessMiddle(stage, context), context)


def _ids(  # type: ignore[no-untyped-def]
    decoder, pipeline: SplitPipeline, prompt: list[int], n: int
) -> tuple[list[int], list]:
    outs = list(decoder(pipeline, prompt, n, frozenset()))
    return [t for o in outs for t in o.tokens], outs


@pytest.fixture(scope="module")
def tapped_model(vocab16_model: Path) -> tuple[ClientModel, Stage]:
    """The same split with a random tapped drafter: it reads the first stage's and the middle's outputs too."""
    files = ModelFiles(str(vocab16_model))
    client_model = ClientModel(files, 1, 1, torch.float64)
    client_model.drafter = random_drafter(files, torch.float64, taps=(1, 2))
    return client_model, Stage.load(files, 1, 2, torch.float64)


@pytest.fixture(scope="module")
def draft_model_split(vocab16_model: Path, vocab16_draft_model: Path) -> tuple[ClientModel, Stage]:
    """The same split drafting with a whole (random, two-layer) draft model of the same vocabulary."""
    files = ModelFiles(str(vocab16_model))
    client_model = ClientModel(files, 1, 1, torch.float64)
    client_model.draft_model = DraftModel(ModelFiles(str(vocab16_draft_model)), torch.float64)
    return client_model, Stage.load(files, 1, 2, torch.float64)


@pytest.fixture(scope="module")
def two_drafters_split(vocab16_model: Path, vocab16_draft_model: Path) -> tuple[ClientModel, Stage]:
    """The same split with a random drafter and a draft model: the gates pick one a step when a cost prices them."""
    files = ModelFiles(str(vocab16_model))
    client_model = ClientModel(files, 1, 1, torch.float64)
    client_model.drafter = random_drafter(files, torch.float64)
    client_model.draft_model = DraftModel(ModelFiles(str(vocab16_draft_model)), torch.float64)
    return client_model, Stage.load(files, 1, 2, torch.float64)


@pytest.mark.parametrize("mode", ["drafter", "auto"])
@pytest.mark.parametrize("drafter", [  # seconds a prompt each: the fast tier keeps the one that drafts with both
    pytest.param("drafter", marks=pytest.mark.slow),
    pytest.param("tapped drafter", marks=pytest.mark.slow),
    pytest.param("draft model", marks=pytest.mark.slow),
    "both, priced",
])
def test_draft_modes_match_sequential(  # type: ignore[no-untyped-def]
    model, tapped_model, draft_model_split, two_drafters_split, mode: str, drafter: str
) -> None:
    model = {"drafter": model, "tapped drafter": tapped_model, "draft model": draft_model_split,
             "both, priced": two_drafters_split}[drafter]
    budget = replace(BIG, cost=NodeCost(step_ms=100.0, node_ms=0.5)) if "priced" in drafter else BIG
    accepted_from_drafter = 0
    for seed in range(4):
        prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        expected, _ = _ids(decode_sequential, _pipeline(model), prompt, 40)
        ids, outs = _ids(SpeculativeDecoder(SpeculationConfig(mode, drafter_policy=StaticPolicy(budget))),
                         _pipeline(model), prompt, 40)
        assert ids == expected, seed
        accepted_from_drafter += sum(n for o in outs for src, n in o.stats.speculation.sources.items()
                                     if "draft" in src)
        assert all(o.stats.timing.draft_ms > 0 for o in outs[1:])
    assert accepted_from_drafter > 10  # the drafter's nodes were accepted (and so its cache kept in step)


@pytest.mark.parametrize("drafter", ["drafter", "draft model"])
def test_a_wider_tree_drafts_more_nodes_and_stays_exact(model, draft_model_split,  # type: ignore[no-untyped-def]
                                                        drafter: str) -> None:
    """`SpeculationConfig.tree` reaches the drafters: two levels of 4 x 6 hold at most 6 + 24 nodes (with
    context lookup's 3 guesses of 2 tokens, 36), of 8 x 8 up to 72 (64 kept)."""
    split = {"drafter": model, "draft model": draft_model_split}[drafter]
    wide = SpecBudget(max_nodes=64, guesses=3, depth=2)
    prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(1)).tolist()
    expected, _ = _ids(decode_sequential, _pipeline(split), prompt, 30)
    nodes = {}
    for shape in (TreeShape(), TreeShape(top_k=8, beam=8)):
        config = SpeculationConfig(Mode.DRAFTER, drafter_policy=StaticPolicy(wide), tree=shape)
        ids, outs = _ids(SpeculativeDecoder(config), _pipeline(split), prompt, 30)
        assert ids == expected, shape
        nodes[shape.beam] = max(o.stats.speculation.drafted for o in outs[1:])
    assert nodes[4] <= 36 < nodes[8]
    with pytest.raises(ValueError, match="top_k and beam of at least 1"):
        TreeShape(beam=0)


def test_the_gate_learns_from_what_each_step_yielded(model, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The gate weighs the tokens a step yielded (and the drafter's share of them): it must see them filled in."""
    seen: list[int] = []
    observe = DraftGate.observe

    def spy(gate: DraftGate, speculation, source: str,  # type: ignore[no-untyped-def]
            drafted_ms: float | None) -> None:
        seen.append(speculation.accepted)
        observe(gate, speculation, source, drafted_ms)

    monkeypatch.setattr(DraftGate, "observe", spy)
    prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(0)).tolist()
    _ids(SpeculativeDecoder(SpeculationConfig(Mode.AUTO, drafter_policy=StaticPolicy(BIG))), _pipeline(model), prompt,
         40)
    assert seen and min(seen) >= 1 and max(seen) > 1


def test_a_conversations_next_turn_starts_from_what_its_gates_learned(model) -> None:  # type: ignore[no-untyped-def]
    """The decoder keeps each drafter's gates and their step count from one generation to the next: a
    new turn goes on from what the last one learned, not from the priors."""
    decoder = SpeculativeDecoder(SpeculationConfig(Mode.AUTO, drafter_policy=StaticPolicy(BIG)))
    prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(0)).tolist()
    _, first = _ids(decoder, _pipeline(model), prompt, 20)
    gate = decoder.gates.draft(DrafterProposer.name)
    learned = (gate.gain, gate.ms, gate.tokens)
    assert decoder.gates.step == len(first) and learned != (GateConfig().prior_gain, 0.0, 1.0)
    _, second = _ids(decoder, _pipeline(model), prompt, 20)
    assert decoder.gates.draft(DrafterProposer.name) is gate and decoder.gates.step == len(first) + len(second)


def test_of_two_drafters_that_pay_the_one_that_saves_more_drafts() -> None:
    """A cheap drafter gaining one token a drafting step against a draft model gaining three for 30 ms:
    over a fast link (20 ms a step) the drafter saves more, over a slow one (200 ms) the draft model."""
    small, big = DraftGate(), DraftGate()
    small.gain, small.ms, small.tokens = 1.0, 2.0, 2.0
    big.gain, big.ms, big.tokens = 3.0, 30.0, 2.0
    assert small.offer(NodeCost(20.0, 1.0), 0) == 8.0 and big.offer(NodeCost(20.0, 1.0), 0) == 0.0
    assert small.offer(NodeCost(200.0, 1.0), 1) == 98.0 and big.offer(NodeCost(200.0, 1.0), 1) == 270.0


def test_the_gate_tries_drafting_less_often_while_it_does_not_pay() -> None:
    """Each try that finds drafting still not paying doubles the wait for the next (up to max_explore);
    once it pays, every step drafts and the wait starts over."""
    gate = DraftGate(GateConfig(explore=8, max_explore=32))
    cost = NodeCost(step_ms=10.0, node_ms=1.0)
    gate.ms = 50.0  # drafting costs more than the tokens it gains are worth
    assert [step for step in range(200) if gate.offer(cost, step) is not None] == [0, 8, 24, 56, 88, 120, 152, 184]
    gate.ms = 0.0
    assert all(gate.offer(cost, step) == 5.0 for step in range(200, 210))  # 0.5 tokens x 10 ms saved
    gate.ms = 50.0
    assert [step for step in range(210, 260) if gate.offer(cost, step) is not None] == [216, 224, 240]


def test_a_step_goes_ahead_while_what_a_taken_one_saves_outweighs_what_a_dropped_one_costs() -> None:
    """Over a slow link to a fast server every prepared tree goes ahead while some are taken up; when the
    server's compute outlasts the link and verifying, only while enough are; and now and then to find out
    again."""
    gate = AheadGate(prior=0.3, explore=8, max_explore=32)
    assert all(gate.offer(80.0, 10.0, 20.0, 15.0, step) for step in range(20))  # nothing lost: always
    slow = AheadGate(prior=0.3, explore=8, max_explore=32)
    # 60 ms saved a hit, 60 ms lost a drop: at 30% taken it does not pay
    assert [step for step in range(100) if slow.offer(80.0, 10.0, 20.0, 150.0, step)] == [0, 8, 24, 56, 88]
    for _ in range(10):
        slow.observe(True)
    assert slow.offer(80.0, 10.0, 20.0, 150.0, 100)  # most are taken now: every step
    idle = AheadGate(prior=0.3, explore=8, max_explore=32)
    for _ in range(20):
        idle.observe(False)  # hardly any taken: the server's compute is wasted, though it costs this client nothing
    assert [step for step in range(40) if idle.offer(80.0, 10.0, 20.0, 15.0, step)] == [0, 8, 24]


def test_drafter_mode_needs_a_drafter(tiny_models, load_client_model) -> None:  # type: ignore[no-untyped-def]
    client_model = ClientModel(ModelFiles(tiny_models["llama"]), 1, 1, torch.float64)
    pipeline = SplitPipeline(client_model, InProcessMiddle(Stage.load(client_model.files, 1, 3, torch.float64), 32), 32)
    with pytest.raises(ValueError, match="needs a drafter"):
        next(SpeculativeDecoder(SpeculationConfig(Mode.DRAFTER))(pipeline, [1, 2, 3], 4, frozenset()))


def test_drafter_cache_follows_the_committed_sequence(model) -> None:  # type: ignore[no-untyped-def]
    """Fed step by step (features of each step's committed nodes, trees grown in between, some steps
    not drafting), the drafter's cache holds exactly what one sync of the whole sequence computes, and
    drafts the same tree given the same calibration (what the stepped proposer learned from the tokens it saw)."""
    client_model, _ = model
    ids = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(9)).tolist()
    features, _ = _pipeline(model).forward(Step(torch.tensor(ids[:-1]), torch.arange(29), Visibility.chain(29)))
    budget, idle = SpecBudget(max_nodes=30, depth=5), SpecBudget(max_nodes=0, depth=5)
    stepped = DrafterProposer(client_model.drafter, client_model, CONTEXT)
    start = 0
    for end in (7, 8, 11, 12, 13, 18, 25, 29):
        stepped.observe(start, features[start:end])
        drafting = end in (8, 13, 29)  # steps that do not draft leave their positions for the next that does
        drafts = stepped.propose(ids[: end + 1], budget if drafting else idle)
        assert drafting == bool(drafts) and stepped.committed == (end if drafting else stepped.committed)
        start = end
    whole = DrafterProposer(client_model.drafter, client_model, CONTEXT)
    whole.observe(0, features)
    whole.calibration = stepped.calibration
    assert whole.propose(ids, budget) == drafts and len(drafts) > 20
    assert stepped.committed == whole.committed == 29
    for a, b in ((stepped.cache.k, whole.cache.k), (stepped.cache.v, whole.cache.v)):
        torch.testing.assert_close(a[..., :29, :], b[..., :29, :], rtol=0, atol=1e-10)


def test_the_drafters_vocabulary_rows_are_read_once_per_drafter(vocab16_model: Path) -> None:
    """Every generation's drafting shares the LM head's rows of the draft vocabulary (reading them back
    from a quantized LM head reads all of it), in the drafter's own precision; a swapped drafter gets
    its own."""
    files = ModelFiles(str(vocab16_model))
    client_model = ClientModel(files, 1, 1, torch.float64)
    client_model.drafter = random_drafter(files, torch.float64)
    first = DrafterProposer(client_model.drafter, client_model, CONTEXT).vocab_head
    assert DrafterProposer(client_model.drafter, client_model, CONTEXT).vocab_head is first
    assert first.weight.dtype == client_model.drafter.dtype
    torch.testing.assert_close(first.weight,
                               client_model.lm_head_rows(client_model.drafter.vocab).to(client_model.drafter.dtype))
    client_model.drafter = random_drafter(files, torch.float64)
    assert client_model.drafter_vocab_head() is not first


def test_draft_model_cache_follows_the_committed_sequence(draft_model_split) -> None:  # type: ignore[no-untyped-def]
    """A draft model catches up on the tokens committed since it last drafted, the prompt in passes of
    bounded rows: its cache then holds what one pass over the whole sequence computes, trees dropped;
    given a history that leaves it, it keeps what the two share."""
    client_model, _ = draft_model_split
    ids = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(9)).tolist()
    budget, idle = SpecBudget(max_nodes=30, depth=5), SpecBudget(max_nodes=0, depth=5)
    stepped = DraftModelProposer(client_model.draft_model, CONTEXT)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(draft_model_proposer, "PREFILL_ROWS", 4)
        for end in (7, 8, 11, 12, 13, 18, 25, 29):
            drafting = end in (8, 13, 29)
            drafts = stepped.propose(ids[: end + 1], budget if drafting else idle)
            assert drafting == bool(drafts)
    whole = DraftModelProposer(client_model.draft_model, CONTEXT)
    whole.calibration = stepped.calibration
    assert whole.propose(ids, budget) == drafts and len(drafts) > 20
    assert stepped.committed == whole.committed == 30
    for a, b in ((stepped.cache.k, whole.cache.k), (stepped.cache.v, whole.cache.v)):
        torch.testing.assert_close(a[..., :30, :], b[..., :30, :], rtol=0, atol=1e-10)
    # Another history sharing the first 20 tokens (a conversation's next turn cut short): the common
    # prefix stays, the rest is fed again.
    other = ids[:20] + [(t + 1) % VOCAB for t in ids[20:26]]
    fresh = DraftModelProposer(client_model.draft_model, CONTEXT)
    fresh.calibration = stepped.calibration
    assert stepped.propose(other, budget) == fresh.propose(other, budget)
    assert stepped.committed == fresh.committed == 26 and stepped.tokens == other
    for a, b in ((stepped.cache.k, fresh.cache.k), (stepped.cache.v, fresh.cache.v)):
        torch.testing.assert_close(a[..., :26, :], b[..., :26, :], rtol=0, atol=1e-10)


@pytest.mark.parametrize("variant", ["avx512", "avx2", "neon"])
def test_a_draft_model_takes_the_leanest_weights_the_kernels_run_beside_quantized_client_layers(
    variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its guesses are only verified, so beside quantized layers on the CPU it takes int4, the leanest form
    every kernel variant runs; beside dense or exact layers (and off the CPU, or without the kernels) it
    follows the client's."""
    monkeypatch.setattr(cpu_kernels, "chosen", lambda: next(v for v in cpu_kernels.VARIANTS if v.name == variant))
    for quantized in ("int8", "int4", "mixed"):
        assert drafting_precision(Precision(torch.bfloat16, quantized)) == Precision(torch.bfloat16, "int4")
    for same in (Precision(), Precision(torch.bfloat16), Precision(torch.bfloat16, "int8", "cuda")):
        assert drafting_precision(same) == same
    monkeypatch.setattr(cpu_kernels, "chosen", lambda: None)
    assert drafting_precision(Precision(torch.bfloat16, "int8")) == Precision(torch.bfloat16, "int8")


def test_the_likely_path_of_a_step_taken_up_begins_at_its_entry(  # type: ignore[no-untyped-def]
    draft_model_split
) -> None:
    """A step sent ahead and taken up verifies below its entry node, which is accepted already: the
    path to prepare after starts there, and its chance is counted from there."""
    from splitllm.drafting.scored_tree import _Node

    client_model, _ = draft_model_split
    proposer = DraftModelProposer(client_model.draft_model, CONTEXT)
    # first level: 1 (0.5) and 2 (0.3); under 1: 3 (0.8 of it) and 4 (0.1 of it)
    proposer.tree = [_Node(1, -1, 1, 0.5, 0, 0.5, children=[2, 3]), _Node(2, -1, 1, 0.3, 0, 0.3),
                     _Node(3, 0, 2, 0.8, 0, 0.4), _Node(4, 0, 2, 0.1, 0, 0.05)]
    held = {(1,), (1, 3), (1, 4)}  # the step taken up at node 1 holds its subtree
    path, chance = proposer.likely_path(lambda tokens: tuple(tokens) in held, entered=True)
    assert path == [1, 3] and chance == pytest.approx(0.8)
    held |= {(2,)}  # a step from the root: its chance counts from there
    assert proposer.likely_path(lambda tokens: tuple(tokens) in held) == ([1, 3], pytest.approx(0.4))


def test_a_draft_model_reads_a_prefill_while_it_is_in_flight(draft_model_split,  # type: ignore[no-untyped-def]
                                                             monkeypatch) -> None:
    """A step whose chain is a prefill (the prompt, a conversation's next turn) sends no draft-model
    tree: the draft model reads those tokens beside the step (`overlap_ms`), a pass while the middle
    computes and the rest after it, so the next step's tree feeds only what that step committed.
    Output stays sequential's."""
    monkeypatch.setattr(draft_model_proposer, "PREFILL_ROWS", 4)  # three passes for the prompt
    waited: list[int] = []

    class Watched(InProcessMiddle):
        def step(self, step, timing, while_waiting=None):  # type: ignore[no-untyped-def]
            out = super().step(step, timing, while_waiting)
            # what it had read when the middle returned
            waited.append(decoder.tree_drafters.draft_model_proposer.committed)
            return out

    client_model, stage = draft_model_split
    decoder = SpeculativeDecoder(SpeculationConfig(Mode.DRAFTER, drafter_policy=StaticPolicy(BIG)))
    pipeline = SplitPipeline(client_model, Watched(stage, CONTEXT), CONTEXT)
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    expected, _ = _ids(decode_sequential, _pipeline(draft_model_split), prompt, 12)
    first = decoder(pipeline, prompt, 12, frozenset())
    out = next(first)
    proposer = decoder.tree_drafters.draft_model_proposer
    assert proposer is not None and proposer.committed == len(prompt) and proposer.tokens == prompt
    assert out.stats.timing.overlap_ms > 0 and not any("draft-model" in s for s in out.stats.speculation.sources)
    assert waited == [4]  # one pass beside the middle's compute, the other two after it
    rest = list(first)
    assert [t for o in (out, *rest) for t in o.tokens] == expected
    assert all(o.stats.timing.overlap_ms == 0 for o in rest)
    # The conversation's next turn (the last answer token, never fed yet, and the new tokens) is a
    # prefill too, read in flight; the draft model's cache kept the earlier turn.
    history = prompt + expected + [1, 2, 3, 4]
    feed = history[len(prompt) + len(expected) - 1 :]
    outs = list(decoder(pipeline, feed, 6, frozenset(), Sampler(history=list(history)), rest[-1].path))
    assert outs[0].stats.timing.overlap_ms > 0 and all(o.stats.timing.overlap_ms == 0 for o in outs[1:])
    assert proposer.tokens[: len(history)] == history


def _drafting(  # type: ignore[no-untyped-def]
    drafting: str, draft_model_split, model, vocab16_model: Path
) -> tuple[ClientModel, Stage]:
    """The split a test drafts with: a random draft model, the model itself as its own draft model, or a
    random learned drafter."""
    client_model, stage = model if drafting == "a random learned drafter" else draft_model_split
    if drafting == "the model itself":
        client_model = ClientModel(client_model.files, 1, 1, torch.float64)
        client_model.draft_model = DraftModel(ModelFiles(str(vocab16_model)), torch.float64)
    return client_model, stage


def _exact_over_a_distance(  # type: ignore[no-untyped-def]
    client_model: ClientModel, stage: Stage, ahead: bool
) -> Iterator[tuple[SpeculativeDecoder, list[int], list[int], list, SplitPipeline]]:
    """Four generations over a `Distant` middle, each checked equal to sequential's: the decoder, prompt,
    ids, steps and pipeline of each."""
    decoder = SpeculativeDecoder(SpeculationConfig(Mode.DRAFTER, drafter_policy=StaticPolicy(replace(BIG, depth=3))))
    for seed in range(4):
        prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        expected, _ = _ids(decode_sequential, _pipeline((client_model, stage)), prompt, 40)
        pipeline = SplitPipeline(client_model, Distant(stage, CONTEXT, ahead=ahead), CONTEXT)
        ids, outs = _ids(decoder, pipeline, prompt, 40)
        assert ids == expected, seed
        yield decoder, prompt, ids, outs, pipeline


@pytest.mark.parametrize("drafting", [pytest.param("a random draft model", marks=pytest.mark.slow), "the model itself"])
def test_a_draft_model_prepares_the_next_tree_while_a_step_is_in_flight(  # type: ignore[no-untyped-def]
    draft_model_split, model, vocab16_model: Path, drafting: str
) -> None:
    """While a step is in flight the draft model drafts the next tree for the step's likeliest outcome; a
    step whose outcome came true takes it and drafts nothing on its critical path. Output stays
    sequential's whatever the guesses were (a random draft model's mostly fail, the model's own come
    true once its calibration learns so), and the draft model's cache follows the committed sequence
    through right and wrong ones."""
    client_model, stage = _drafting(drafting, draft_model_split, model, vocab16_model)
    prepared = adopted = 0
    for decoder, prompt, ids, outs, _ in _exact_over_a_distance(client_model, stage, ahead=False):
        assert all(o.stats.timing.overlap_ms > 0 for o in outs if o.stats.speculation.prepared)
        prepared += sum(o.stats.speculation.prepared for o in outs)
        adopted += sum(o.stats.speculation.adopted for o in outs)
        # its cache may hold guesses: drafting after the real history drops them
        proposer = decoder.tree_drafters.draft_model_proposer
        fresh = DraftModelProposer(client_model.draft_model, CONTEXT)
        fresh.calibration = proposer.calibration
        proposer.prepared = None  # (a tree prepared for the sequence's end would be taken instead)
        budget = SpecBudget(max_nodes=30, depth=5)
        assert proposer.propose(prompt + ids, budget) == fresh.propose(prompt + ids, budget)
    assert prepared > 12 and (adopted > 4 if drafting == "the model itself" else adopted < prepared)


@pytest.mark.parametrize("mode", ["lookahead", "auto", "drafter"])
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
    client_model = ClientModel(ModelFiles(folder), 1, 1, torch.float64)
    url = server(folder, 1, 1, max_context=40, dtype=torch.float64).url
    prompt = [7, 8, 9, 10] * 7

    def run(decoder) -> list[int]:  # type: ignore[no-untyped-def]
        middle = RemoteMiddle(url, client_model.files.fingerprint, client_model.middle_range, "float32", 96)
        try:
            return _ids(decoder, SplitPipeline(client_model, middle, 96), prompt, 12)[0]
        finally:
            middle.close()

    assert run(SpeculativeDecoder(SpeculationConfig(Mode.LOOKAHEAD, StaticPolicy(BIG)))) == run(decode_sequential)


def test_a_depth_is_drafted_only_while_its_pass_can_pay(draft_model_split) -> None:  # type: ignore[no-untyped-def]
    """Priced by a link cost, a tree grows deeper only while the chances of the nodes a pass would run,
    at what a token is worth there, exceed the measured time of a pass."""
    client_model, _ = draft_model_split
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    priced = SpecBudget(max_nodes=30, depth=5, cost=NodeCost(step_ms=100.0, node_ms=1.0))
    depths = {}
    for pass_ms in (1e-6, 1e6):
        proposer = DraftModelProposer(client_model.draft_model, CONTEXT)
        proposer.pass_ms = pass_ms
        depths[pass_ms] = max(len(d.tokens) for d in proposer.propose(ids, priced))
    assert depths[1e6] == 1 and depths[1e-6] > 2


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_extending_a_cache_equals_a_step_of_the_same_positions(tiny_models, name: str) -> None:
    """`Stage.extend` (explicit visibility over the cache, as drafting trees need) computes what a step
    does for a causal chain, sliding windows (8 here) included: 20 positions, the last 8 appended apart."""
    files = ModelFiles(str(tiny_models[name]))
    stage = Stage.load(files, 0, files.config.num_layers, torch.float32)
    hidden = torch.randn(20, files.config.hidden_size, generator=torch.Generator().manual_seed(0))
    expected = stage(stage.new_cache(32), Step(hidden, torch.arange(20), Visibility.chain(20)))
    cache = stage.new_cache(32)
    stage.extend(cache, hidden[:12], torch.arange(12), torch.ones(12, 12, dtype=torch.bool).tril())
    sees = torch.cat([torch.ones(8, 12, dtype=torch.bool), torch.ones(8, 8, dtype=torch.bool).tril()], 1)
    got = stage.extend(cache, hidden[12:], torch.arange(12, 20), sees)
    torch.testing.assert_close(got, expected[12:], rtol=1e-4, atol=1e-4)  # float32 products of other shapes


@pytest.mark.parametrize("drafting", ["a random draft model", "the model itself", "a random learned drafter"])
def test_a_step_sent_ahead_on_the_likely_outcome_keeps_the_output_sequentials(  # type: ignore[no-untyped-def]
    draft_model_split, model, vocab16_model: Path, drafting: str
) -> None:
    """The prepared tree goes to the middle while the step before it is in flight; taken up when the model
    chooses one of its first-level tokens, dropped (and the caches cropped back, the outcome's tokens fed
    again) when not. Output stays sequential's through both, and every cache ends where the path says.
    A learned drafter, which reads the target's features, prepares below the likely path from its own
    guesses of them."""
    client_model, stage = _drafting(drafting, draft_model_split, model, vocab16_model)
    sent = taken = 0
    for _, prompt, ids, outs, pipeline in _exact_over_a_distance(client_model, stage, ahead=True):
        sent += sum(o.stats.speculation.sent_ahead for o in outs)
        taken += sum(o.stats.speculation.ran_ahead for o in outs)
        assert pipeline.committed + len(outs[-1].path) == len(prompt) + len(ids) - 1
    assert sent > 0 and (taken > 2 if drafting == "the model itself" else taken <= sent)


def test_steps_sent_ahead_over_a_real_server_stay_exact_across_generations(  # type: ignore[no-untyped-def]
    vocab16_model: Path, server
) -> None:
    """Over a server on loopback (protocol crops and all), steps go ahead of the one in flight, are taken
    up or dropped, and a second generation on the same session after the first (which may end with a
    step ahead dropped) goes on exactly where sequential decoding of the whole sequence would."""
    files = ModelFiles(str(vocab16_model))
    client_model = ClientModel(files, 1, 1, torch.float64)
    client_model.draft_model = DraftModel(files, torch.float64)
    url = server(vocab16_model, 1, 1, dtype=torch.float64).url
    stage = Stage.load(files, 1, 2, torch.float64)
    decoder = SpeculativeDecoder(SpeculationConfig(Mode.DRAFTER, drafter_policy=StaticPolicy(replace(BIG, depth=3))))
    sent = taken = 0
    for seed in range(3):
        first, more = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(seed)).tolist()
        remote = SplitPipeline(client_model,
                               RemoteMiddle(url, files.fingerprint, client_model.middle_range, "float32", 96), 96)
        ids, outs = _ids(decoder, remote, first, 24)
        ids2 = [t for o in decoder(remote, ids[-1:] + more, 24, frozenset(), keep=outs[-1].path) for t in o.tokens]
        local = _pipeline((client_model, stage), 96)
        expected, steps = _ids(decode_sequential, local, first, 24)
        expected2 = [t for o in decode_sequential(local, expected[-1:] + more, 24, frozenset(),
                                                  keep=steps[-1].path) for t in o.tokens]
        assert (ids, ids2) == (expected, expected2), seed
        sent += sum(o.stats.speculation.sent_ahead for o in outs)
        taken += sum(o.stats.speculation.ran_ahead for o in outs)
        remote.middle.close()
    assert sent > 3 and taken > 0
