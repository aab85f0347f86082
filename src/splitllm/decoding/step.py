"""What a decoder yields per round trip."""

from __future__ import annotations

from dataclasses import dataclass

from splitllm.stats import StepStats


@dataclass
class StepOutput:
    tokens: list[int]
    stats: StepStats
