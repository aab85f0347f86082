"""The decoding modes by name, each a factory of a fresh decoder.

A decoder is called with (scorer, prompt, max_new_tokens, stop_ids, sampler=, keep=) and yields a
`StepOutput` per round trip. Factories, not instances, so every conversation gets its own policy
state (what `auto` learns about a link belongs to the conversation that measured it); a factory takes
the `SuffixCache` of earlier requests its conversation's owner may draft from (`suffixes=`, None: none).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Mapping
from types import MappingProxyType

from splitllm.decoding.mode_names import Mode
from splitllm.decoding.proposers.suffix import SuffixCache
from splitllm.decoding.speculation_config import SPECULATIVE_MODES, SpeculationConfig
from splitllm.decoding.sizing.policies import AdaptivePolicy, ValuePolicy
from splitllm.decoding.sequential import decode_sequential
from splitllm.decoding.speculative import SpeculativeDecoder
from splitllm.decoding.step import StepOutput

Decoder = Callable[..., Generator[StepOutput, None, None]]


def _auto(suffixes: SuffixCache | None = None) -> Decoder:
    """Sizes each step for the link it measures; with a drafter, keeps the tree's nodes worth verifying."""
    return SpeculativeDecoder(SpeculationConfig(Mode.AUTO, AdaptivePolicy(), drafter_policy=ValuePolicy()), suffixes)


# Keyed by `Mode`, a StrEnum, so a mode's name finds its factory too.
DECODERS: Mapping[str, Callable[..., Decoder]] = MappingProxyType({
    Mode.SEQUENTIAL: lambda suffixes=None: decode_sequential,
    **{
        mode: functools.partial(SpeculativeDecoder, SpeculationConfig(mode))
        for mode in SPECULATIVE_MODES
        if mode != Mode.AUTO
    },
    Mode.AUTO: _auto,
})


def check_mode(name: str) -> Mode:
    """The mode called `name`; otherwise a ValueError listing the modes."""
    if name not in DECODERS:
        raise ValueError(f"unknown decode mode {name!r}; choose from {', '.join(DECODERS)}")
    return Mode(name)
