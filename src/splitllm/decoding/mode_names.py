"""The decoding modes by name, and the default one.

Apart from the decoders (`modes`) and their setup (`speculation_config`), so that whoever only names a
mode (the command line's options and help) imports neither torch nor numpy.
"""

from __future__ import annotations

from enum import StrEnum


class Mode(StrEnum):
    """A decoding mode; every one but `sequential` is speculative (`speculation_config.SPECULATIVE_MODES`)."""

    SEQUENTIAL = "sequential"
    LOOKAHEAD = "lookahead"
    LOOKUP = "lookup"
    DRAFTER = "drafter"  # every step drafted by the learned drafter or a draft model, beside context lookup
    AUTO = "auto"


DEFAULT_DECODE = Mode.AUTO  # the fastest exact mode: output equals sequential greedy decoding
