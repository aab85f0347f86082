"""Constrained decoding: the tokens a grammar allows next, for JSON schemas and tool calls.

A `Grammar` is compiled once per request; the sampler starts one `GrammarState` per generation and,
at every node it chooses a token for, masks the logits to what the grammar allows after everything
committed so far, then advances the state by the chosen token. Speculation needs nothing more: the
verifier asks the sampler node by node along the accepted path, in the order sequential decoding
would, so under the same grammar a tree's committed tokens are the ones sequential decoding commits,
and sampled ones follow the same masked distribution. Drafts are cut where the grammar rejects them
(`accepted`), which saves tree room and changes no output.

llguidance does the matching (MIT, no Python dependencies, Rust): its per-token mask cost was measured
against xgrammar and outlines-core on the models shipped here (`splitllm bench grammar`,
docs/results/grammar.json); xgrammar's is lower still, but it pulls in a GPU compiler (triton) as a
dependency, and outlines-core's is several times higher and needs the vocabulary as bytes.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import llguidance
import llguidance.hf
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # typed in llguidance's stub only
    from transformers import PreTrainedTokenizerFast

# The JSON the grammar admits: the separators models write by habit, no other whitespace, so a greedy
# model cannot spin on blank lines inside an object.
JSON_STYLE: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_tokenizer(
    tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_ids: Collection[int]
) -> llguidance.LLTokenizer:
    """llguidance's view of a model's vocabulary (built once per model: it reads every token).

    `vocab_size` is the LM head's (rows past the tokenizer's are never allowed); every stop id ends a
    generation the grammar has completed."""
    # llguidance types a fast tokenizer, and raises a ValueError for any other.
    fast = cast("PreTrainedTokenizerFast", tokenizer)
    return llguidance.hf.from_tokenizer(fast, n_vocab=vocab_size, eos_token=sorted(stop_ids))


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled constraint on a generation's output, over one model's vocabulary."""

    tokenizer: llguidance.LLTokenizer
    source: str  # llguidance's grammar text

    @classmethod
    def compile(cls, tokenizer: llguidance.LLTokenizer, source: str) -> Grammar:
        """ValueError with llguidance's message where the grammar is not usable."""
        error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, tokenizer)
        if error:
            raise ValueError(f"the grammar is not usable: {messages[0]}")
        return cls(tokenizer, source)

    @classmethod
    def json_schema(cls, tokenizer: llguidance.LLTokenizer, schema: dict[str, Any] | None = None) -> Grammar:
        """Any JSON object (`schema` None), or JSON valid under `schema`."""
        schema = {"type": "object"} if schema is None else schema
        return cls.compile(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE))

    @classmethod
    def lark(cls, tokenizer: llguidance.LLTokenizer, source: str) -> Grammar:
        return cls.compile(tokenizer, llguidance.LLMatcher.grammar_from_lark(source))

    def start(self) -> GrammarState:
        return GrammarState(self)


def json_rule(schema: dict[str, Any]) -> str:
    """A Lark rule body matching JSON under `schema`, in the style `JSON_STYLE` sets."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE})


class GrammarState:
    """Where one generation is in its grammar."""

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self.matcher = llguidance.LLMatcher(grammar.tokenizer, grammar.source, log_level=0)
        self._check()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise ValueError(f"constrained decoding failed: {self.matcher.get_error()}")

    def allowed(self, size: int) -> torch.Tensor:
        """Which of the `size` logits the grammar allows next, as a bool mask."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[:size].astype(bool)
        if mask.size < size:
            mask = np.pad(mask, (0, size - mask.size))
        return torch.from_numpy(mask)

    def advance(self, token: int) -> None:
        """Take the chosen token (one the mask allowed)."""
        self.matcher.consume_token(token)
        self._check()

    def accepted(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, from here, the grammar allows in a row (the state is left unchanged)."""
        n = self.matcher.try_consume_tokens(list(tokens))
        if n:
            self.matcher.rollback(n)
        return n
