"""The decoding modes by name, each a factory of a fresh decoder.

A decoder is called with (scorer, prompt, max_new_tokens, stop_ids, sampler=, keep=) and yields a
`StepOutput` per round trip. Factories, not instances, so every conversation gets its own policy
state (what `auto` learns about a link belongs to the conversation that measured it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

from splitllm.decoding.policy import AdaptivePolicy, ValuePolicy
from splitllm.decoding.sequential import decode_sequential
from splitllm.decoding.speculative import MODES as SPECULATIVE_MODES
from splitllm.decoding.speculative import SpeculativeDecoder
from splitllm.decoding.step import StepOutput

Decoder = Callable[..., Iterator[StepOutput]]

DECODERS: dict[str, Callable[[], Decoder]] = {
    "sequential": lambda: decode_sequential,
    **{mode: functools.partial(SpeculativeDecoder, mode) for mode in SPECULATIVE_MODES},
    # sizes each step for the link it measures; with a draft head, keeps the tree's nodes worth verifying
    "auto": lambda: SpeculativeDecoder("auto", AdaptivePolicy(), head_policy=ValuePolicy()),
}
DEFAULT_DECODE = "auto"  # the fastest exact mode: output equals sequential greedy decoding


def check_mode(name: str) -> str:
    """`name` if it is a decoding mode; otherwise a ValueError listing the modes."""
    if name not in DECODERS:
        raise ValueError(f"unknown decode mode {name!r}; choose from {', '.join(DECODERS)}")
    return name
