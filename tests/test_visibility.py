"""Visibility: construction, wire round trips, sliding-window masks, and what trees and general
patterns compute (each node's logits equal decoding exactly what it sees)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import DEFAULT_MODEL_CASE
from hypothesis import given, settings
from hypothesis import strategies as st

from splitllm.protocol import messages
from splitllm.protocol.messages import StepMessage
from splitllm.model.stage import Step
from splitllm.model.visibility import Visibility

ATOL, RTOL = 1e-4, 1e-5  # float32 logits of the default model reach ~20: its rounding scales with them


def _round_trip(vis: Visibility) -> Visibility:
    parents, bits = vis.to_wire()
    sent = StepMessage("s", torch.zeros(vis.n, 1), "float32", tuple(range(vis.n)), parents=parents, bits=bits)
    got = messages.decode(messages.encode(sent), (StepMessage,))
    return Visibility.from_wire(got.parents, got.bits, vis.n)


# --- construction and encoding ---------------------------------------------------------------------


def test_parents_give_ancestor_rows() -> None:
    vis = Visibility.from_parents([-1, 0, 0, 1, -1, 4])
    expected = [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 1, 1],
    ]
    assert vis.matrix.int().tolist() == expected
    assert torch.equal(Visibility.chain(4).matrix, torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, 2, 0], [-2], [-1, True], [-1, 0.0], [-1, "0"], [-1, None]])
def test_bad_parents_are_refused(parents) -> None:
    with pytest.raises(ValueError, match="parent of node"):
        Visibility.from_parents(parents)


def test_bad_matrices_are_refused() -> None:
    with pytest.raises(ValueError, match="square"):
        Visibility.from_matrix(np.ones((2, 3), dtype=bool))
    with pytest.raises(ValueError, match="see itself"):
        Visibility.from_matrix(np.zeros((2, 2), dtype=bool))


@st.composite
def _matrices(draw: st.DrawFn) -> np.ndarray:
    n = draw(st.integers(1, 40))
    bits = draw(st.lists(st.booleans(), min_size=n * n, max_size=n * n))
    m = np.array(bits, dtype=bool).reshape(n, n)
    np.fill_diagonal(m, True)
    return m


@settings(max_examples=60, deadline=None)
@given(_matrices())
def test_bit_matrix_survives_the_wire(matrix: np.ndarray) -> None:
    vis = Visibility.from_matrix(matrix)
    parents, bits = vis.to_wire()
    assert parents is None and bits is not None and len(bits) == (vis.n**2 + 7) // 8
    back = _round_trip(vis)
    assert back.parents is None and torch.equal(back.matrix, vis.matrix)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=40))
def test_parents_survive_the_wire(seeds: list[int]) -> None:
    parents = [s % (i + 1) - 1 for i, s in enumerate(seeds)]  # each in [-1, i)
    vis = Visibility.from_parents(parents)
    back = _round_trip(vis)
    assert back.parents == tuple(parents) and torch.equal(back.matrix, vis.matrix)


def test_wire_fields_are_checked() -> None:
    assert torch.equal(Visibility.from_wire(None, None, 3).matrix, Visibility.chain(3).matrix)
    with pytest.raises(ValueError, match="list of 3"):
        Visibility.from_wire([-1, 0], None, 3)
    with pytest.raises(ValueError, match="2 bytes for 3"):
        Visibility.from_wire(None, b"\xff", 3)
    with pytest.raises(ValueError, match="2 bytes for 3"):
        Visibility.from_wire(None, "ab", 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="see itself"):
        Visibility.from_wire(None, b"\x00\x00", 3)


# --- masks -------------------------------------------------------------------------------------------


def test_mask_fast_path_and_shape() -> None:
    cache_pos = torch.arange(5)
    assert Visibility.chain(1).additive_mask(cache_pos, torch.tensor([5]), None, torch.float32) is None
    mask = Visibility.chain(3).additive_mask(cache_pos, torch.tensor([5, 6, 7]), None, torch.float32)
    assert mask is not None and mask.shape == (1, 1, 3, 8)
    assert (mask[0, 0, :, :5] == 0).all()
    assert torch.equal(mask[0, 0, :, 5:] == 0, Visibility.chain(3).matrix)


@pytest.mark.parametrize("window", [1, 3, 8])
def test_sliding_window_mask(window: int) -> None:
    """Position p sees position q iff the pattern allows it and p - q < window (as transformers)."""
    cache_pos = torch.tensor([0, 1, 2, 3, 4, 5, 6, 9])  # compacted caches hold gaps
    vis = Visibility.from_parents([-1, 0, 0, 1, 3])
    positions = torch.tensor([10, 11, 11, 12, 13])
    mask = vis.additive_mask(cache_pos, positions, window, torch.float32)
    assert mask is not None
    for i, p in enumerate(positions.tolist()):
        for j, q in enumerate(cache_pos.tolist()):
            assert (mask[0, 0, i, j] == 0) == (p - q < window)
        for j, q in enumerate(positions.tolist()):
            assert (mask[0, 0, i, len(cache_pos) + j] == 0) == (bool(vis.matrix[i, j]) and p - q < window)
    assert set(mask.unique().tolist()) <= {0.0, float("-inf")}


# --- what a step computes ------------------------------------------------------------------------------


def _random_tree(n: int, seed: int) -> tuple[list[int], list[int]]:
    """Parents (a forest off the committed cache) and depths of n nodes."""
    rng = np.random.default_rng(seed)
    parents = [int(rng.integers(-1, i)) for i in range(n)]
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return parents, depth


def _path(parents: list[int], i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


def _vocab(model) -> int:
    return 49152 if model is None else 512


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", DEFAULT_MODEL_CASE])
def test_tree_node_logits_equal_its_path_alone(name, tiny_models, pipeline, random_ids) -> None:
    model = None if name == "default" else tiny_models[name]
    prompt = random_ids(13, 21, _vocab(model))
    nodes = random_ids(14, 22, _vocab(model))
    parents, depth = _random_tree(len(nodes), seed=23)
    p = pipeline(model)
    p.score(Step(torch.tensor(prompt), torch.arange(len(prompt)), Visibility.chain(len(prompt))))
    positions = torch.tensor([len(prompt) + d for d in depth])
    tree, _ = p.score(Step(torch.tensor(nodes), positions, Visibility.from_parents(parents), range(len(prompt))))
    for i in range(len(nodes)):
        path = [nodes[j] for j in _path(parents, i)]
        seq = prompt + path
        alone, _ = pipeline(model).score(
            Step(torch.tensor(seq), torch.arange(len(seq)), Visibility.chain(len(seq))),
            rows=torch.tensor([len(seq) - 1])
        )
        torch.testing.assert_close(tree[i], alone[0], rtol=RTOL, atol=ATOL, msg=lambda m, i=i: f"node {i}: {m}")


@pytest.mark.parametrize("name", ["llama", DEFAULT_MODEL_CASE])
def test_bit_matrix_step_matches_transformers_custom_mask(name, tiny_models, pipeline, hf_model, random_ids) -> None:
    """A general (non-tree) pattern: each row sees an arbitrary subset of the new positions."""
    model = None if name == "default" else tiny_models[name]
    prompt, nodes = random_ids(11, 31, _vocab(model)), random_ids(9, 32, _vocab(model))
    rng = np.random.default_rng(33)
    see = rng.random((9, 9)) < 0.4
    np.fill_diagonal(see, True)
    positions = torch.tensor(rng.integers(len(prompt), len(prompt) + 5, size=9))
    vis = _round_trip(Visibility.from_matrix(see))
    p = pipeline(model)
    p.score(Step(torch.tensor(prompt), torch.arange(len(prompt)), Visibility.chain(len(prompt))))
    ours, _ = p.score(Step(torch.tensor(nodes), positions, vis, range(len(prompt))))
    total = len(prompt) + len(nodes)
    mask = torch.zeros(total, total, dtype=torch.bool)
    mask[: len(prompt), : len(prompt)] = Visibility.chain(len(prompt)).matrix
    mask[len(prompt) :, : len(prompt)] = True
    mask[len(prompt) :, len(prompt) :] = torch.from_numpy(see)
    with torch.no_grad():
        ref = hf_model(model)(
            torch.tensor([prompt + nodes]),
            attention_mask=mask[None, None],
            position_ids=torch.cat([torch.arange(len(prompt)), positions])[None],
        ).logits[0, len(prompt) :]
    torch.testing.assert_close(ours, ref, rtol=RTOL, atol=ATOL)


def test_tree_as_bits_equals_tree_as_parents(tiny_models, pipeline, random_ids) -> None:
    parents, depth = _random_tree(10, seed=41)
    as_parents = Visibility.from_parents(parents)
    as_bits = Visibility.from_matrix(as_parents.matrix.numpy())
    out = []
    for vis in (as_parents, as_bits):
        p = pipeline(tiny_models["qwen2"], 1, 1)
        p.score(Step(torch.tensor(random_ids(6, 42)), torch.arange(6), Visibility.chain(6)))
        logits, _ = p.score(Step(torch.tensor(random_ids(10, 43)), torch.tensor(depth) + 6, vis, range(6)))
        out.append(logits)
    assert torch.equal(out[0], out[1])
