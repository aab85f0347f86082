"""Prompts longer than the server's `max_nodes` go as several steps; the server's `max_context` is honoured."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from conftest import TINY_SPLIT
from protocol_client import greedy

from splitllm.client.pipeline import InProcessMiddle
from splitllm.client.remote import RemoteMiddle
from splitllm.client.client import SplitClient
from splitllm.model.precision import fastest
from splitllm.stats import StepTiming
from splitllm.model.stage import Step
from splitllm.model.visibility import Visibility

FIRST, LAST = TINY_SPLIT


def test_cuts_split_chains_and_keep_trees_whole() -> None:
    assert Visibility.chain(10).cuts(4) == [(0, 4), (4, 8), (8, 10)]
    assert Visibility.chain(4).cuts(4) == [(0, 4)]
    # a 7-position prompt, then a tree of 4 hanging off its last position: never cut inside the tree
    tree = Visibility.from_parents([-1, 0, 1, 2, 3, 4, 5, 6, 6, 7])
    assert tree.cuts(4) == [(0, 4), (4, 7), (7, 10)]
    assert tree.cuts(2) == [(0, 2), (2, 4), (4, 6), (6, 7), (7, 10)]  # the tree is wider than 2: whole
    lookahead = Visibility.from_matrix(torch.eye(6, dtype=torch.bool))  # nothing sees anything earlier
    assert lookahead.cuts(4) == [(0, 6)]


# Cut by the client (steps of at most max_nodes) or sliced by the server (forwards of slice_rows).
CUTS = [{"max_nodes_per_step": 8}, {"slice_rows": 3, "slice_above": 3}]


@pytest.mark.parametrize("limits", CUTS, ids=["client", "server"])
def test_prompt_three_times_max_nodes_decodes_exactly(  # type: ignore[no-untyped-def]
    tiny_models, server, load_client_model, pipeline, random_ids, limits
) -> None:
    tiny = tiny_models["mistral"]  # sliding window 8: cuts must not change which positions see which
    thread = server(tiny, FIRST, LAST, dtype=torch.float32, **limits)
    client_model, prompt = load_client_model(tiny, FIRST, LAST), random_ids(29, 4)
    want = greedy(client_model, pipeline(tiny, FIRST, LAST, 64).middle, prompt, 12)
    remote = RemoteMiddle(thread.url, client_model.files.fingerprint, client_model.middle_range, "float32", 64)
    assert greedy(client_model, remote, prompt, 12) == want


@pytest.mark.parametrize("limits", CUTS, ids=["client", "server"])
def test_cut_steps_then_trees_and_keeps_match_one_forward(  # type: ignore[no-untyped-def]
    tiny_models, server, load_client_model, middle_stage, limits
) -> None:
    tiny = tiny_models["llama"]
    thread = server(tiny, FIRST, LAST, dtype=torch.float32, **limits)
    client_model = load_client_model(tiny, FIRST, LAST)
    width = client_model.files.config.hidden_size
    remote = RemoteMiddle(thread.url, client_model.files.fingerprint, client_model.middle_range, "float32", 64)
    solo = InProcessMiddle(middle_stage(tiny, FIRST, LAST), 64)
    g = torch.Generator().manual_seed(3)
    steps = [
        (torch.randn(20, width, generator=g), torch.arange(20), Visibility.chain(20), []),
        (torch.randn(3, width, generator=g), torch.tensor([10, 11, 11]), Visibility.from_parents([-1, 0, 0]),
         list(range(10))),
        (torch.randn(2, width, generator=g), torch.tensor([12, 13]), Visibility.chain(2), [0, 2]),
    ]
    for hidden, positions, vis, keep in steps:
        got = remote.step(Step(hidden, positions, vis, keep), StepTiming())
        want = solo.step(Step(hidden, positions, vis, keep), StepTiming())
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # Client cuts: the second step dropped entries the first one's parts had committed, so the client
    # rebuilt its session; server slices are reopened after the step, so nothing is ever lost.
    assert remote.reconnects == (1 if "max_nodes_per_step" in limits else 0)
    remote.close()


def test_work_while_waiting_runs_a_piece_while_each_request_is_in_flight(  # type: ignore[no-untyped-def]
    tiny_models, server, load_client_model, middle_stage
) -> None:
    """A step's `while_waiting` (a draft model reading the prompt, a pass per piece) runs one piece after
    each request of a cut step is sent, while the server computes that part; the rest is the caller's."""
    tiny = tiny_models["llama"]
    thread = server(tiny, FIRST, LAST, dtype=torch.float32, max_nodes_per_step=8)
    client_model = load_client_model(tiny, FIRST, LAST)
    remote = RemoteMiddle(thread.url, client_model.files.fingerprint, client_model.middle_range, "float32", 64)
    registry = thread.server.metrics.registry

    def computed() -> float:
        return sum(
            s.value
            for m in registry.collect()
            if m.name == "splitllm_steps"
            for s in m.samples
            if s.name.endswith("_total")
        )

    seen: list[float] = []  # parts the server had computed when each piece ran
    stepped = False  # after the step, the pieces left are the caller's: nothing is in flight to wait for
    base = computed()

    def pieces() -> Iterator[None]:
        for i in range(5):
            deadline = time.monotonic() + 30
            # the part sent before this piece
            while not stepped and computed() < base + i + 1 and time.monotonic() < deadline:
                time.sleep(0.005)
            seen.append(computed() - base)
            yield

    work = pieces()
    hidden = torch.randn(20, client_model.files.config.hidden_size, generator=torch.Generator().manual_seed(5))
    step = Step(hidden, torch.arange(20), Visibility.chain(20))
    got = remote.step(step, StepTiming(), work)
    stepped = True
    want = InProcessMiddle(middle_stage(tiny, FIRST, LAST), 64).step(step, StepTiming())
    assert seen == [1.0, 2.0, 3.0]  # one piece per part (three), each after its part was sent and before the next
    assert len(list(work)) == 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    remote.close()


@pytest.fixture(scope="module")
def default_client() -> SplitClient:
    """The default (fastest) precision, its hidden states sent in their own dtype, so nothing is rounded on the wire."""
    precision = fastest()
    return SplitClient(None, first=2, last=2, max_context=512, precision=precision, wire_dtype=precision.dtype_name)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sequential", "lookup"])
def test_default_model_long_prompt_over_a_small_max_nodes(default_client, server,  # type: ignore[no-untyped-def]
                                                          mode) -> None:
    """The prompt cut into 16-row steps gives the tokens of one in-process step, the server in the client's
    precision."""
    prompt = "Repeat this list back: " + ", ".join(f"item {i}" for i in range(20)) + "."
    default_client.server = None
    want = default_client.generate(prompt, 16, mode)
    precision = default_client.precision
    thread = server(None, 2, 2, max_nodes_per_step=16, dtype=precision.dtype, quant=precision.quant)
    default_client.server = thread.url
    try:
        got = default_client.generate(prompt, 16, mode)
    finally:
        default_client.server = None
    assert len(got.prompt_ids) > 3 * 16
    assert got.ids == want.ids


@pytest.mark.slow
def test_server_max_context_is_checked_before_the_first_step(default_client,  # type: ignore[no-untyped-def]
                                                             server) -> None:
    thread = server(None, 2, 2, max_context=48)
    default_client.server = thread.url
    try:
        with pytest.raises(ValueError, match="server's maximum context of 48"):
            default_client.generate("Tell me about owls.", 40)
        assert thread.server.metrics.total("splitllm_steps_total") == 0
        assert default_client.generate("Hi.", 8).finish_reason in ("stop", "length")  # what fits still runs
    finally:
        default_client.server = None
