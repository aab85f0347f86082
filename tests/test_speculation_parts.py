"""Pieces of speculative decoding on their own: candidates, the token tree, the verifier, the step layout."""

from __future__ import annotations

import numpy as np
import pytest

from splitllm.decoding.sizing.budget import SpecBudget
from splitllm.decoding.sizing.calibration import CandidateRates
from splitllm.decoding.proposers import Candidate
from splitllm.decoding.proposers.lookahead import LookaheadWindow
from splitllm.decoding.proposers.lookup import ContextLookup
from splitllm.decoding.layout import plan_step
from splitllm.decoding.tree import ROOT, CandidateTree
from splitllm.decoding.verifier import verify


def test_lookup_prefers_the_longest_then_the_latest_match() -> None:
    history = [1, 2, 3, 9, 2, 3, 7, 5, 2, 3]
    candidates = ContextLookup().propose(history, SpecBudget(guesses=3, depth=2))
    # suffix [2, 3] occurs twice before the end: latest first; then the 1-gram [3] adds nothing new
    assert [d.tokens for d in candidates] == [(7, 5), (9, 2)]


def test_lookup_extends_a_loop_periodically() -> None:
    history = [5, 1, 2, 1, 2, 1]
    (candidate,) = ContextLookup().propose(history, SpecBudget(guesses=1, depth=5))
    assert candidate.tokens == (2, 1, 2, 1, 2)


def test_lookup_index_grows_with_the_history() -> None:
    lookup, history = ContextLookup(), [1, 2]
    assert lookup.propose(history, SpecBudget(guesses=2)) == []
    history += [1]
    assert [d.tokens for d in lookup.propose(history, SpecBudget(guesses=2, depth=3))] == [(2, 1, 2)]


def test_tree_shares_prefixes_and_keeps_ancestors_under_a_budget() -> None:
    candidates = [Candidate((1, 2, 3), "a", 0.9), Candidate((1, 2, 4), "b", 0.5), Candidate((5,), "b", 0.1)]
    tree = CandidateTree.build(candidates, max_nodes=10, max_depth=8)
    assert tree.tokens == [1, 2, 3, 4, 5] and tree.parents == [ROOT, 0, 1, 1, ROOT]
    assert tree.sources[1] == ("a", "b") and tree.depths == [1, 2, 3, 3, 1]
    small = CandidateTree.build(candidates, max_nodes=3, max_depth=8)
    assert small.tokens == [1, 2, 3] and small.parents == [ROOT, 0, 1]
    assert CandidateTree.build(candidates, max_nodes=10, max_depth=1).tokens == [1, 5]


def test_verifier_accepts_the_matching_path_plus_one() -> None:
    tree = CandidateTree.build([Candidate((1, 2, 3), "a", 0.9), Candidate((1, 4), "b", 0.5)], 10, 8)
    argmax = {ROOT: 1, 0: 4, 3: 8}  # node 3 is the candidate token 4
    verdict = verify(tree, lambda node, _: argmax[node], limit=10, stop_ids=())
    assert verdict.tokens == (1, 4, 8) and verdict.path == (0, 3) and not verdict.stopped
    assert verify(tree, lambda node, _: argmax[node], limit=2, stop_ids=()).tokens == (1, 4)
    stopped = verify(tree, lambda node, _: argmax[node], limit=10, stop_ids={4})
    assert stopped.tokens == (1, 4) and stopped.stopped


def test_step_layout_separates_tree_and_window() -> None:
    window = LookaheadWindow(seed=1)
    layout = window.layout([7, 8, 9], SpecBudget(window=3, levels=3))
    tree = CandidateTree.build([Candidate((4, 5), "a", 1.0), Candidate((6,), "a", 0.5)], 10, 8)
    plan = plan_step([10, 11], start=20, tree=tree, window=layout)
    c, t, w = 2, len(tree), len(layout.tokens)
    assert w == 3 * 3 - 1 and len(plan.tokens) == c + t + w
    m = plan.vis.matrix.numpy()
    assert m[:, :c].sum() == c * (c + 1) // 2 + (t + w) * c  # chain causal, everyone sees the chain
    assert not m[c : c + t, c + t :].any() and not m[c + t :, c : c + t].any()
    assert plan.positions[:c] == [20, 21] and plan.positions[c : c + t] == [22, 23, 22]
    # window: level 0 columns 1..2 at root+1..2; level j column i at root + j + i
    assert plan.positions[c + t :] == [22, 23, 22, 23, 24, 23, 24, 25]
    assert plan.window_rows == [c + t + 5, c + t + 6, c + t + 7]
    # level-2 column 1 sees level-0 column 1 and levels 1..2 of column 1, nothing else in the window
    row = m[c + t + 6, c + t :]
    assert np.flatnonzero(row).tolist() == [0, 3, 6]


def test_lookahead_harvests_column_ngrams_and_shifts() -> None:
    window = LookaheadWindow()
    window.levels = [[11, 12], [20, 21, 22], [30, 31, 32]]  # W = 3, N - 1 = 3
    window.advance(root=5, outputs=[40, 41, 42])
    assert window.levels == [[21, 22], [30, 31, 32], [40, 41, 42]]
    assert list(window.pool[5]) == [(20, 30, 40)] and list(window.pool[12]) == [(22, 32, 42)]
    candidates = window.propose([1, 5], SpecBudget(guesses=2, depth=2))
    assert [d.tokens for d in candidates] == [(20, 30)] and candidates[0].source == "lookahead"


@pytest.mark.parametrize("bad", [dict(max_nodes=-1), dict(window=1, levels=2), dict(window=3, levels=1)])
def test_budget_validation(bad: dict) -> None:
    with pytest.raises(ValueError):
        SpecBudget(**bad)


def test_calibration_learns_from_what_was_committed() -> None:
    cal = CandidateRates()
    good, bad = Candidate((1, 2, 3), "lookup", 0.5), Candidate((9, 9), "lookahead", 0.5)
    prior = cal.rates(good)
    history = [0, 0, 0]
    for _ in range(10):
        cal.track([good, bad], len(history))
        cal.resolve(history)  # nothing decided yet: no token after the candidates' start
        history += [1, 2, 3]
        cal.resolve(history)
    (first_good, next_good), (first_bad, _) = cal.rates(good), cal.rates(bad)
    assert first_good > prior[0] > first_bad and next_good > prior[1]
    # a candidate right so far stays pending until the history decides its remaining tokens
    cal.track([Candidate((4, 5), "lookup", 0.25)], len(history))
    cal.resolve(history + [4])
    assert cal.rates(Candidate((4,), "lookup", 0.25))[0] == CandidateRates().rates(Candidate((4,), "lookup", 0.25))[0]


def test_tree_ranks_nodes_by_rates() -> None:
    candidates = [Candidate((1, 2, 3), "a", 0.5), Candidate((4, 5), "b", 0.5)]
    deep = CandidateTree.build(candidates, max_nodes=3, max_depth=8, rates=[(0.9, 0.95), (0.5, 0.5)])
    assert deep.tokens == [1, 2, 3]
    wide = CandidateTree.build(candidates, max_nodes=3, max_depth=8, rates=[(0.9, 0.1), (0.5, 0.5)])
    assert wide.tokens == [1, 4, 5]


def test_scored_candidates_stand_for_one_node_each() -> None:
    """The drafter's nodes carry their own scores; n-gram candidates add theirs along their paths."""
    head = [Candidate((1,), "draft", 0.8, 0.8), Candidate((1, 2), "draft", 0.5, 0.4),
            Candidate((3,), "draft", 0.1, 0.1),
            Candidate((1, 2, 6), "draft", 0.2, 0.08)]
    candidates = [*head, Candidate((1, 4), "lookup", 0.3)]
    rates = [(0.5, 0.5)] * 4 + [(0.3, 0.5)]  # unused by scored candidates
    tree = CandidateTree.build(candidates, max_nodes=3, max_depth=8, rates=rates)
    # scores: 1: 0.8 + 0.3, (1, 2): 0.4, (1, 4): 0.3 * 0.5, 3: 0.1, (1, 2, 6): 0.08
    assert (tree.tokens, tree.parents) == ([1, 2, 4], [ROOT, 0, 0])
    assert tree.sources == [("draft", "lookup"), ("draft",), ("lookup",)]
    assert CandidateTree.build(candidates, max_nodes=10, max_depth=2, rates=rates).tokens == [1, 2, 3, 4]
