"""Step traces: everything the speculative decoder sends to the model and emits, step by step, in
scenarios that cover each of its paths (every mode, a learned drafter, a draft model preparing and
sending steps ahead that are taken up and dropped, a sampled generation, a conversation's next turn,
a generation stopped mid-way). A trace pins the decoder's behaviour, not only its output, so a
reshape of the speculative core that changes what goes on the wire shows here.

The traces are recorded per CPU kind (the model's bits are the machine's) into
tests/data/step_traces/<kind>.json with `pytest tests/test_step_traces.py --record-traces`; where no
trace of this kind was recorded, the test checks that two recordings agree.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Distant, random_drafter

from splitllm.client.client_model import ClientModel
from splitllm.client.pipeline import InProcessMiddle, SplitPipeline
from splitllm.decoding.mode_names import Mode
from splitllm.decoding.sampling import Sampler, SamplingParams
from splitllm.decoding.sizing.budget import SpecBudget
from splitllm.decoding.sizing.policies import StaticPolicy
from splitllm.decoding.speculation_config import SpeculationConfig
from splitllm.decoding.speculative import SpeculativeDecoder
from splitllm.drafting.draft_model import DraftModel
from splitllm.kernels import cpu_kernels
from splitllm.model.stage import Stage, Step
from splitllm.weights.sources import ModelFiles

VOCAB = 16
CONTEXT = 96
BIG = SpecBudget(max_nodes=40, window=4, levels=3, guesses=3, depth=8)
TRACES = Path(__file__).parent / "data" / "step_traces"
Events = list[list[Any]]


class Recording:
    """A scorer that writes down each call the decoder makes of it (what goes on the wire and back)."""

    def __init__(self, scorer: SplitPipeline, events: Events) -> None:
        self._scorer, self.events = scorer, events

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scorer, name)

    @staticmethod
    def _step(step: Step) -> list[Any]:
        vis = step.vis.parents if step.vis.parents is not None else step.vis.matrix.int().tolist()
        return [step.inputs.tolist(), step.positions.tolist(), list(vis), list(step.keep)]

    def forward(self, step: Step, timing: Any = None, while_waiting: Iterator[object] | None = None) -> Any:
        self.events.append(["forward", *self._step(step)])
        return self._scorer.forward(step, timing, while_waiting)

    def send_ahead(self, step: Step, timing: Any) -> None:
        self.events.append(["send_ahead", *self._step(step)])
        self._scorer.send_ahead(step, timing)

    def receive_ahead(self, timing: Any, while_waiting: Iterator[object] | None = None) -> torch.Tensor:
        self.events.append(["receive_ahead"])
        return self._scorer.receive_ahead(timing, while_waiting)

    def drop_ahead(self) -> None:
        self.events.append(["drop_ahead"])
        self._scorer.drop_ahead()

    def logits(self, hidden: torch.Tensor, timing: Any) -> torch.Tensor:
        self.events.append(["logits", len(hidden)])
        return self._scorer.logits(hidden, timing)

    def approx_logits(self, hidden: torch.Tensor, timing: Any) -> torch.Tensor:
        self.events.append(["approx_logits", len(hidden)])
        return self._scorer.approx_logits(hidden, timing)


def _run(decoder: Any, scorer: SplitPipeline, prompt: list[int], n: int, events: Events, stop_after: int | None = None,
         sampler: Sampler | None = None, keep: list[int] | None = None) -> list[int]:
    """One generation, its calls and its steps (tokens, path, what it speculated) into `events`; the last
    step's path."""
    outs = decoder(Recording(scorer, events), prompt, n, frozenset(), sampler, keep or [])
    path: list[int] = []
    for out in itertools.islice(outs, stop_after):
        speculation = asdict(out.stats.speculation)
        events.append(["step", out.tokens, out.path, speculation])
        path = out.path
    outs.close()
    return path


def _prompts(seeds: range, n: int = 6) -> list[list[int]]:
    return [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(s)).tolist() for s in seeds]


def _static(mode: Mode, **kwargs: Any) -> SpeculativeDecoder:
    return SpeculativeDecoder(SpeculationConfig(mode, StaticPolicy(BIG), drafter_policy=StaticPolicy(BIG), **kwargs))


def record(vocab16_model: Path, vocab16_draft_model: Path) -> dict[str, Events]:
    """Every scenario's trace."""
    files = ModelFiles(str(vocab16_model))
    stage = Stage.load(files, 1, 2, torch.float64)
    learned = ClientModel(files, 1, 1, torch.float64)
    learned.drafter = random_drafter(files, torch.float64)
    drafting = ClientModel(files, 1, 1, torch.float64)
    drafting.draft_model = DraftModel(ModelFiles(str(vocab16_draft_model)), torch.float64)
    itself = ClientModel(files, 1, 1, torch.float64)
    itself.draft_model = DraftModel(files, torch.float64)
    repetitive = [3, 4, 5, 6] * 5 + [3, 4]
    traces: dict[str, Events] = {}

    def local(client_model: ClientModel) -> SplitPipeline:
        return SplitPipeline(client_model, InProcessMiddle(stage, CONTEXT), CONTEXT)

    def distant(client_model: ClientModel) -> SplitPipeline:  # the client's core free while a step is in flight
        return SplitPipeline(client_model, Distant(stage, CONTEXT, flight_ms=1000.0, wait=False), CONTEXT)

    for mode in (Mode.LOOKUP, Mode.LOOKAHEAD, Mode.AUTO, Mode.DRAFTER):
        events = traces.setdefault(f"in-process {mode}", [])
        decoder = _static(mode)
        for prompt in [repetitive, *_prompts(range(2))]:
            _run(decoder, local(learned), prompt, 24, events)
    for name, client_model in (("a draft model", drafting), ("the model itself", itself),
                               ("a learned drafter", learned)):
        events = traces.setdefault(f"sent ahead, {name}", [])
        decoder = SpeculativeDecoder(SpeculationConfig(Mode.DRAFTER,
                                                       drafter_policy=StaticPolicy(replace(BIG, depth=3))))
        for prompt in _prompts(range(3)):
            _run(decoder, distant(client_model), prompt, 32, events)
    events = traces.setdefault("a conversation's next turn, stopped mid-way", [])
    decoder = _static(Mode.AUTO)
    for prompt in _prompts(range(2)):
        scorer = distant(itself)
        path = _run(decoder, scorer, prompt, 20, events)
        _run(decoder, scorer, [prompt[-1], *prompt[:4]], 30, events, stop_after=3, keep=path)
    events = traces.setdefault("sampled, seeded", [])
    for prompt in [repetitive, *_prompts(range(2))]:
        sampler = Sampler(SamplingParams(do_sample=True, temperature=0.8, seed=7), history=prompt)
        _run(_static(Mode.AUTO), local(learned), prompt, 24, events, sampler=sampler)
    return traces


def test_the_speculative_core_does_what_it_did(vocab16_model: Path, vocab16_draft_model: Path,
                                               request: pytest.FixtureRequest) -> None:
    """This CPU kind's recorded traces are what the decoder does now, scenario by scenario."""
    traces = json.loads(json.dumps(record(vocab16_model, vocab16_draft_model)))
    assert all(any(e[0] == "step" for e in events) for events in traces.values())
    sent = [e for events in traces.values() for e in events if e[0] == "send_ahead"]
    taken = [e for events in traces.values() for e in events if e[0] == "receive_ahead"]
    assert sent and taken and len(taken) < len(sent)  # steps sent ahead were taken up and dropped
    kind = cpu_kernels.widest()
    path = TRACES / f"{kind.name if kind is not None else 'portable'}.json"
    if request.config.getoption("--record-traces"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(traces, separators=(",", ":")) + "\n")
    expected = json.loads(path.read_text()) if path.exists() else record(vocab16_model, vocab16_draft_model)
    expected = json.loads(json.dumps(expected))
    for name in expected:
        assert traces[name] == expected[name], name
