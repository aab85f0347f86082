"""What a decoder yields per round trip."""

from __future__ import annotations

from dataclasses import dataclass

from splitllm.stats import StepStats


@dataclass
class StepOutput:
    """`tokens` this step emitted; `stats`: its timing and what it speculated; `path`: this step's nodes
    that carry the sequence, in order (the fed tokens the emitted ones extend), which the next step's
    `keep` commits. The last emitted token is never fed, so emitting k tokens leaves `path` ending at
    the node that produced the k-th."""

    tokens: list[int]
    stats: StepStats
    path: list[int]
