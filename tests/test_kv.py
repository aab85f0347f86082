"""KV cache edits against recomputation: appending in steps, cropping, and keep-by-index compaction
must all leave the caches exactly as if the surviving sequence had been decoded from scratch."""

from __future__ import annotations

import pytest
import torch
from conftest import DEFAULT_MODEL_CASE

from splitllm.client.pipeline import InProcessMiddle, SplitPipeline
from splitllm.client.remote import RemoteMiddle
from splitllm.model.kv import KVCache
from splitllm.model.stage import Step
from splitllm.model.visibility import Visibility

ATOL = 1e-4
MODELS = ["llama", "mistral", DEFAULT_MODEL_CASE]  # mistral: positions far past its 8-token window


def _model(name, tiny_models):
    return None if name == "default" else tiny_models[name]


def _tokens(name, random_ids, n: int, seed: int) -> list[int]:
    return random_ids(n, seed, vocab=49152 if name == "default" else 512)


def _chain(pipeline, tokens: list[int], start: int, keep: list[int]) -> torch.Tensor:
    n = len(tokens)
    logits, _ = pipeline.score(Step(torch.tensor(tokens), torch.arange(start, start + n), Visibility.chain(n), keep))
    return logits


def _caches(pipeline) -> list[KVCache]:
    return [c for c in (pipeline.caches.first, pipeline.middle.cache, pipeline.caches.last) if c is not None]


# --- the cache alone -------------------------------------------------------------------------------


def _filled(pending: int, committed: int = 3) -> KVCache:
    """A one-layer cache with `committed` final entries and `pending` entries whose values are their index."""
    cache = KVCache(1, 1, 2, 16, torch.float32)
    cache.stage_new(torch.arange(committed))
    cache.keep(list(range(committed)))
    cache.stage_new(torch.arange(100, 100 + pending))
    for i in range(committed + pending):
        cache.k[0, 0, 0, i] = i
        cache.v[0, 0, 0, i] = -i
    return cache


def test_keep_compacts_chosen_entries_in_order() -> None:
    cache = _filled(pending=5)
    cache.keep([1, 3, 4])
    assert (cache.length, cache.pending) == (6, 0)
    assert cache.k[0, 0, 0, :6, 0].tolist() == [0, 1, 2, 4, 6, 7]
    assert cache.v[0, 0, 0, :6, 0].tolist() == [0, -1, -2, -4, -6, -7]
    assert cache.positions[:6].tolist() == [0, 1, 2, 101, 103, 104]


def test_keep_prefix_and_nothing() -> None:
    cache = _filled(pending=4)
    cache.keep([0, 1])
    assert (cache.length, cache.k[0, 0, 0, :5, 0].tolist()) == (5, [0, 1, 2, 3, 4])
    cache.stage_new(torch.tensor([7]))
    cache.keep([])
    assert (cache.length, cache.pending) == (5, 0)


@pytest.mark.parametrize("keep", [[2, 1], [0, 0], [5], [-1], [0.0], [True], ["0"]])
def test_bad_keep_is_refused_untouched(keep) -> None:
    cache = _filled(pending=5)
    before = cache.k.clone()
    with pytest.raises(ValueError, match="strictly increasing"):
        cache.keep(keep)
    # Bit for bit: the entries past those written are uninitialized memory (caches fill lazily), NaNs among them.
    assert (cache.length, cache.pending) == (3, 5) and torch.equal(cache.k.view(torch.int32), before.view(torch.int32))


def test_crop_and_room_limits() -> None:
    cache = _filled(pending=2)
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(4)
    cache.crop(1)
    assert (cache.length, cache.pending) == (1, 0)
    with pytest.raises(ValueError, match="maximum context of 16"):
        cache.stage_new(torch.arange(16))
    assert cache.nbytes == 2 * 16 * 2 * 4


# --- caches of the whole split model against recomputation ----------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_appending_in_steps_equals_one_pass(name, tiny_models, pipeline, random_ids) -> None:
    model = _model(name, tiny_models)
    tokens = _tokens(name, random_ids, 30, seed=1)
    full = _chain(pipeline(model), tokens, 0, [])
    p = pipeline(model)
    start, keep, rows = 0, [], []
    for size in (7, 1, 12, 1, 1, 8):  # prefill, single tokens, chunks, as decoders send them
        rows.append(_chain(p, tokens[start : start + size], start, keep))
        keep, start = list(range(size)), start + size
    # float32 sums in another order for 1 row than for 30 (MKL): logits of ~20 differ by ~1e-4 on some CPUs
    torch.testing.assert_close(torch.cat(rows), full, rtol=1e-4, atol=ATOL)


@pytest.mark.parametrize("name", MODELS)
def test_crop_then_continue_equals_fresh(name, tiny_models, pipeline, random_ids) -> None:
    model = _model(name, tiny_models)
    tokens = _tokens(name, random_ids, 40, seed=2)
    p = pipeline(model)
    _chain(p, tokens[:25], 0, [])
    _chain(p, tokens[25:30], 25, list(range(25)))
    for cache in _caches(p):
        cache.crop(18)
    cropped = _chain(p, tokens[30:40], 18, [])
    fresh = _chain(pipeline(model), tokens[:18] + tokens[30:40], 0, [])
    assert (cropped - fresh[18:]).abs().max().item() < ATOL


@pytest.mark.parametrize("name", MODELS)
def test_keep_by_index_then_continue_equals_decoding_kept_sequence(name, tiny_models, pipeline, random_ids) -> None:
    """Commit a scattered path of a speculative tree, then keep decoding: same as never branching."""
    model = _model(name, tiny_models)
    prompt = _tokens(name, random_ids, 14, seed=3)
    tree = _tokens(name, random_ids, 8, seed=4)
    parents = [-1, 0, 0, 1, 2, 2, 4, 5]  # accepted path: 0 -> 2 -> 4 -> 6
    depth = [0, 1, 1, 2, 2, 2, 3, 3]
    path = [0, 2, 4, 6]
    more = _tokens(name, random_ids, 6, seed=5)
    p = pipeline(model)
    _chain(p, prompt, 0, [])
    n0 = len(prompt)
    positions = torch.tensor([n0 + d for d in depth])
    p.score(Step(torch.tensor(tree), positions, Visibility.from_parents(parents), range(n0)))
    after_keep = _chain(p, more[:1], n0 + len(path), path)
    after_chunk = _chain(p, more[1:], n0 + len(path) + 1, [0])
    fresh = _chain(pipeline(model), prompt + [tree[i] for i in path] + more, 0, [])
    assert (torch.cat([after_keep, after_chunk]) - fresh[-len(more) :]).abs().max().item() < ATOL
    assert all(c.length == n0 + len(path) + 1 for c in _caches(p))


def test_keep_over_the_wire_equals_local(tiny_models, load_client_model, middle_stage, server, random_ids) -> None:
    """The server applies keep exactly as the client's stages do (tiny Mistral: windows and compaction)."""
    folder = tiny_models["mistral"]
    client_model = load_client_model(folder, 2, 1)
    url = server(folder, 2, 1, dtype=torch.float32).url
    remote = RemoteMiddle(url, client_model.files.fingerprint, client_model.middle_range, "float32", 64)
    try:
        runs = [SplitPipeline(client_model, m, 64) for m in (remote, InProcessMiddle(middle_stage(folder, 2, 1), 64))]
        prompt, tree = random_ids(20, seed=6), random_ids(6, seed=7)
        out = []
        for p in runs:
            _chain(p, prompt, 0, [])
            positions, parents = torch.tensor([20, 21, 21, 22, 22, 23]), Visibility.from_parents([-1, 0, 0, 2, 2, 4])
            p.score(Step(torch.tensor(tree), positions, parents, range(20)))
            out.append(_chain(p, tree[:3], 24, [0, 2, 4, 5]))
        assert (out[0] - out[1]).abs().max().item() < 1e-5
    finally:
        remote.close()
