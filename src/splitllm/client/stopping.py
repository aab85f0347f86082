"""Where a generation ends: an EOS id, a stop string or the token budget.

Applied to every step's tokens after the decoder, so sequential and speculative decoding end on the
same token with the same text even when a speculative step ran past the end.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase


class StopRule:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        stop_ids: frozenset[int],
        stop: Sequence[str] = (),
        max_new_tokens: int = 128,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.tokenizer, self.stop_ids, self.stop, self.max_new_tokens = tokenizer, stop_ids, tuple(stop), max_new_tokens

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _cut(self, text: str) -> int | None:
        """Index of the first stop string in `text`, if any."""
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def clip(self, ids: Sequence[int], new: Sequence[int]) -> tuple[list[int], str | None]:
        """The part of `new` that follows `ids`, and why the generation ends there ("stop", "length")
        or None when it goes on. A stop string ends it on the token that completes the string."""
        new = list(new[: self.max_new_tokens - len(ids)])
        reason = "length" if len(ids) + len(new) >= self.max_new_tokens else None
        for i, token in enumerate(new):
            if token in self.stop_ids:
                new, reason = new[: i + 1], "stop"
                break
        if self.stop and self._cut(self.decode([*ids, *new])) is not None:
            n = next(n for n in range(1, len(new) + 1) if self._cut(self.decode([*ids, *new[:n]])) is not None)
            new, reason = new[:n], "stop"
        return new, reason

    def text(self, ids: Sequence[int]) -> str:
        """The generated text, cut before the first stop string."""
        text = self.decode(ids)
        cut = self._cut(text)
        return text if cut is None else text[:cut]

    def stable(self, text: str) -> str:
        """The prefix of `text` that later tokens cannot change: without an incomplete character or
        a tail that may still grow into a stop string (what streaming shows before the end)."""
        text = text.rstrip("\ufffd")
        hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return text[: len(text) - hold]
