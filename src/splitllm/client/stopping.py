"""Where a generation ends: an EOS id, a stop string or the token budget; and its text so far.

Applied to every step's tokens after the decoder, so sequential and speculative decoding end on the
same token with the same text even when a speculative step ran past the end. Text is decoded
incrementally (a window of a few tokens per new token), so a step costs the same at the first token
as at the two-thousandth, and stop strings are searched only where new text can complete one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from transformers import PreTrainedTokenizerBase

INCOMPLETE = "\ufffd"  # what a byte-level tokenizer decodes a partial UTF-8 character to


def stop_ids(tokenizer: PreTrainedTokenizerBase, hf_config: object) -> frozenset[int]:
    """The ids that end an answer: the tokenizer's end of sequence and the model config's (chat models
    end a turn with a token of their own, such as <|im_end|>)."""
    eos = tokenizer.eos_token_id
    gen_eos = getattr(hf_config, "eos_token_id", None)
    return frozenset(
        i for i in ([eos] if isinstance(eos, int) else []) + (gen_eos if isinstance(gen_eos, list) else [gen_eos])
        if isinstance(i, int)
    )


class IncrementalText:
    """The text of a growing token sequence, decoding only the tokens since the last complete piece.

    A token's text can depend on its neighbours (merged spaces, characters split over tokens), so each
    new token is decoded together with the previous piece's tokens and only the difference is kept;
    text ending in an incomplete character waits for the token that completes it.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""  # final: later tokens cannot change it
        self._prefix = 0  # start of the window decoded for context
        self._read = 0  # tokens already turned into `text`

    def _decode(self, ids: Sequence[int]) -> str:
        return cast(str, self.tokenizer.decode(list(ids), skip_special_tokens=True))  # one sequence: text

    def push(self, token: int) -> str:
        """Add a token; return the text it completes (often its own, sometimes more, or nothing yet)."""
        self.ids.append(token)
        done = self._decode(self.ids[self._prefix : self._read])
        full = self._decode(self.ids[self._prefix :])
        if len(full) <= len(done) or full.endswith(INCOMPLETE):
            return ""
        piece = full[len(done) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += piece
        return piece

    def pending(self) -> str:
        """Text of the tokens not turned into `text` yet (an incomplete character, at the end)."""
        done = self._decode(self.ids[self._prefix : self._read])
        return self._decode(self.ids[self._prefix :])[len(done) :]


class StopRule:
    """One generation's end condition and text; `clip` each step's tokens in order."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        stop_ids: frozenset[int],
        stop: Sequence[str] = (),
        max_new_tokens: int = 128,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop_ids, self.stop, self.max_new_tokens = stop_ids, tuple(stop), max_new_tokens
        self._longest = max((len(s) for s in self.stop), default=0)
        self._text = IncrementalText(tokenizer)
        self._cut: int | None = None  # where the first stop string starts, once one is complete

    @property
    def ids(self) -> list[int]:
        """The tokens accepted so far."""
        return self._text.ids

    def _find(self, since: int) -> int | None:
        """Start of the first stop string ending after text index `since` (none ended before it)."""
        start = max(since - self._longest + 1, 0)
        window = self._text.text[start:]
        found = [i for i in (window.find(s) for s in self.stop) if i >= 0]
        return start + min(found) if found else None

    def clip(self, new: Sequence[int]) -> tuple[list[int], str | None]:
        """The part of `new` the generation keeps, and why it ends there ("stop", "length") or None
        when it goes on. A stop string ends it on the token that completes the string."""
        new = list(new[: self.max_new_tokens - len(self.ids)])
        reason = "length" if len(self.ids) + len(new) >= self.max_new_tokens else None
        for i, token in enumerate(new):
            before = len(self._text.text)
            if self._text.push(token) and self.stop:
                self._cut = self._find(before)
            if self._cut is not None or token in self.stop_ids:
                return new[: i + 1], "stop"
        return new, reason

    def text(self, final: bool = False) -> str:
        """The generated text, cut before the first stop string. Unless `final`, only what later
        tokens cannot change: no incomplete character, no tail that may still grow into a stop string."""
        if self._cut is not None:
            return self._text.text[: self._cut]
        if final:
            return self._text.text + self._text.pending()
        text = self._text.text
        hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return text[: len(text) - hold]
