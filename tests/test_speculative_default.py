"""The real default model in the fastest setting here: every speculative mode commits sequential greedy's
tokens bit for bit, splitllm's kernels giving a row the same bits in any step (docs/correctness.md).

A small subset of `splitllm bench exactness` (32 prompts x 128 tokens), plus the step statistics
speculation reports."""

from __future__ import annotations

import pytest
import torch

from splitllm.lab.bench.exactness import check_exactness
from splitllm.lab.data.workload import workload
from splitllm.client.client import SplitClient
from splitllm.decoding.sizing.budget import AUTO_BUDGET
from splitllm.decoding.mode_names import Mode
from splitllm.decoding.speculation_config import SpeculationConfig
from splitllm.decoding.sizing.policies import StaticPolicy
from splitllm.decoding.speculative import SpeculativeDecoder


@pytest.fixture(scope="module")
def client():  # type: ignore[no-untyped-def]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    client = SplitClient(None, max_context=512)
    if not client.client_model.row_invariant:
        pytest.skip("no splitllm kernel variant runs on this CPU: speculation is refused (test_precision.py)")
    yield client
    torch.set_num_threads(before)


@pytest.mark.slow
def test_modes_match_sequential_on_the_default_model(client) -> None:  # type: ignore[no-untyped-def]
    prompts = [p.text for p in workload(1)[::2]]  # code and creative
    report = check_exactness(client, prompts, max_new_tokens=32)
    assert sum(report.identical.values()) == len(report.modes) * len(prompts), report.markdown()


@pytest.mark.slow
def test_speculation_accepts_drafts_and_reports_them(client) -> None:  # type: ignore[no-untyped-def]
    prompt = "List ten fruits with their typical colors, one per line, as 'fruit: color'."
    # In-process there is no round trip to adapt to, so the adaptive policy would rightly not speculate.
    static = SpeculativeDecoder(SpeculationConfig(Mode.AUTO, StaticPolicy(AUTO_BUDGET)))
    gen = client.generate(prompt, 48, decode=static)
    decode_steps = [s.speculation for s in gen.steps[1:]]
    assert len(gen.ids) == 48 and gen.tokens_per_step > 1.2
    assert {s.proposer for s in decode_steps} - {""} <= {"lookup", "lookahead"}
    assert any(s.proposer for s in decode_steps)
    assert all(s.timing.nodes == 1 + s.speculation.drafted + s.speculation.window for s in gen.steps[1:])
    assert sum(s.speculation.accepted for s in gen.steps) == 48


@pytest.mark.slow
def test_draft_mode_with_the_shipped_drafter_matches_sequential_over_a_server(  # type: ignore[no-untyped-def]
    server
) -> None:
    """The shipped drafter drafts over a real server on loopback, both sides in the fastest setting:
    sequential's tokens, and the drafter's nodes get accepted."""
    url = server(None, 2, 2).url
    remote = SplitClient(None, url, max_context=512)
    assert remote.client_model.drafter is not None, "no drafter is shipped for the default model"
    prompt = "Explain in three sentences why the sky is blue."
    expected = remote.generate(prompt, 48).ids
    gen = remote.generate(prompt, 48, decode="drafter")
    assert gen.ids == expected
    decode_steps = gen.steps[1:]
    assert sum(n for s in decode_steps for src, n in s.speculation.sources.items() if "draft" in src) > 0
    assert all(s.timing.draft_ms > 0 for s in decode_steps) and gen.tokens_per_step > 1.0
