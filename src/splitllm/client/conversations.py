"""Conversations kept open between requests, so a chat turn sends its new tokens, not its whole past.

An OpenAI-style request carries the whole conversation every time. Each request's prompt is matched
against the conversations kept from earlier requests: the one whose tokens so far are the longest
prefix of the prompt goes on, with its server session and caches, and only the rest of the prompt is
read. A conversation continues only when everything it holds is a prefix of the new prompt, so one
conversation's cache never serves another's text. Given the prompt's text too (a chat template's
output), a conversation whose text is a prefix also goes on: a model's own tokens for its answer may
differ from how the tokenizer would split the same text (forced tool calls often do), and the
conversation then keeps the model's own. Kept conversations are bounded in count and bytes
and dropped least recently used first, or after `idle_s` unused (their server sessions close too).
Where requests carry API keys, a conversation goes on only for the key that started it, and each key's
earlier requests draft for its later ones (a `SuffixCache` per key, `suffix_tokens` long), never another's.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import cast

from splitllm.client.client import Conversation, Generation, SplitClient
from splitllm.decoding.modes import Decoder
from splitllm.decoding.proposers.suffix import MAX_TOKENS, SuffixCache
from splitllm.decoding.sampling import SamplingParams
from splitllm.decoding.step import StepOutput


@dataclass(frozen=True)
class _Kept:
    conversation: Conversation
    used: float  # time.monotonic() when it last generated
    text: str  # its tokens as text, special tokens included
    owner: str | None  # whose requests it continues (an API key), None for all


@dataclass(frozen=True)
class ReuseLimits:
    """How many conversations stay open, how much client memory their caches may hold, and for how long; and
    how many tokens of each owner's earlier requests stay to draft from."""

    max_conversations: int = 8
    max_bytes: int = 2 << 30
    idle_s: float = 600.0  # the server's default session lifetime: a longer wait would replay anyway
    suffix_tokens: int = MAX_TOKENS  # each owner's earlier requests' tokens kept to draft from (0: none)


class ConversationCache:
    """The recent conversations of one client, one generation at a time (the caller serializes them)."""

    def __init__(self, client: SplitClient, limits: ReuseLimits = ReuseLimits()) -> None:
        self.client, self.limits = client, limits
        self._kept: OrderedDict[int, _Kept] = OrderedDict()  # least recently used first
        self._ids = 0
        self._suffixes: dict[str | None, SuffixCache] = {}  # by owner: one principal's requests draft for them alone

    def __len__(self) -> int:
        return len(self._kept)

    def _take(self, prompt: Sequence[int], text: str | None, owner: str | None) -> tuple[Conversation, list[int], int]:
        """The kept conversation of `owner` the prompt continues (taken out while it generates), the tokens
        it has yet to read and how many it holds; a new conversation, the whole prompt and 0 when none does."""
        self._expire()
        mine = {key: kept for key, kept in self._kept.items() if kept.owner == owner}
        best, held = None, 0
        for key, kept in mine.items():
            n = len(kept.conversation.ids)
            if held < n < len(prompt) and kept.conversation.ids == list(prompt[:n]):
                best, held = key, n
        if best is not None:
            return self._kept.pop(best).conversation, list(prompt[held:]), held
        if text is not None:
            found = [(len(k.text), key) for key, k in mine.items()
                     if len(k.text) < len(text) and text.startswith(k.text)]
            if found:
                kept = self._kept.pop(max(found)[1])
                rest = self.client.tokenizer(text[len(kept.text) :], add_special_tokens=False)["input_ids"]
                return kept.conversation, rest, len(kept.conversation.ids)
        return self.client.conversation(suffixes=self._suffixes_of(owner)), list(prompt), 0

    def _suffixes_of(self, owner: str | None) -> SuffixCache | None:
        if not self.limits.suffix_tokens:
            return None
        if owner not in self._suffixes:
            self._suffixes[owner] = SuffixCache(self.limits.suffix_tokens)
        return self._suffixes[owner]

    def _keep(self, conv: Conversation, owner: str | None) -> None:
        if not conv.ids:  # closed after a failure: nothing to continue
            return
        self._ids += 1
        self._kept[self._ids] = _Kept(conv, time.monotonic(), cast(str, self.client.tokenizer.decode(conv.ids)), owner)
        while len(self._kept) > self.limits.max_conversations or (
            len(self._kept) > 1 and sum(k.conversation.nbytes for k in self._kept.values()) > self.limits.max_bytes
        ):
            self._drop(next(iter(self._kept)))

    def _drop(self, key: int) -> None:
        self._kept.pop(key).conversation.close()

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, kept in self._kept.items() if now - kept.used > self.limits.idle_s]:
            self._drop(key)

    def stream(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        decode: str | Decoder,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        text: str | None = None,
        owner: str | None = None,
    ) -> Generator[tuple[Generation, StepOutput, int], None, None]:
        """Generate after `prompt` (whose text `text` is, if given) like `SplitClient.stream`, in a
        conversation only `owner`'s requests continue; each item also says how many tokens an earlier
        request had already read (0: a fresh conversation)."""
        conv, rest, held = self._take(prompt, text, owner)
        try:
            for gen, out in conv.stream(rest, max_new_tokens, decode, sampling, stop):
                yield gen, out, held
        finally:
            self._keep(conv, owner)  # a generation stopped between steps is consistent: it may go on later

    def close(self) -> None:
        while self._kept:
            self._drop(next(iter(self._kept)))
