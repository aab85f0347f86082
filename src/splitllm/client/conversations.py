"""Conversations kept open between requests, so a chat turn sends its new tokens, not its whole past.

An OpenAI-style request carries the whole conversation every time. Each request's prompt is matched
against the conversations kept from earlier requests: the one whose tokens so far are the longest
prefix of the prompt goes on, with its server session and caches, and only the rest of the prompt is
read. A conversation continues only when everything it holds is a prefix of the new prompt, so one
conversation's cache never serves another's text. Kept conversations are bounded in count and bytes
and dropped least recently used first, or after `idle_s` unused (their server sessions close too).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from splitllm.client.session import Conversation, Generation, SplitClient
from splitllm.decoding.modes import Decoder
from splitllm.decoding.sampling import SamplingParams
from splitllm.decoding.step import StepOutput


@dataclass(frozen=True)
class ReuseLimits:
    """How many conversations stay open, how much client memory their caches may hold, and for how long."""

    max_conversations: int = 8
    max_bytes: int = 2 << 30
    idle_s: float = 600.0  # the server's default session lifetime: a longer wait would replay anyway


class ConversationCache:
    """The recent conversations of one client, one generation at a time (the caller serializes them)."""

    def __init__(self, client: SplitClient, limits: ReuseLimits = ReuseLimits()) -> None:
        self.client, self.limits = client, limits
        self._kept: OrderedDict[int, tuple[Conversation, float]] = OrderedDict()  # least recently used first
        self._ids = 0

    def __len__(self) -> int:
        return len(self._kept)

    def _take(self, prompt: Sequence[int]) -> tuple[Conversation, int]:
        """The kept conversation that `prompt` continues (taken out while it generates) and how many of the
        prompt's tokens it holds; a new conversation and 0 when none does."""
        self._expire()
        best, held = None, 0
        for key, (conv, _) in self._kept.items():
            n = len(conv.ids)
            if held < n < len(prompt) and conv.ids == list(prompt[:n]):
                best, held = key, n
        if best is None:
            return self.client.conversation(), 0
        return self._kept.pop(best)[0], held

    def _keep(self, conv: Conversation) -> None:
        if not conv.ids:  # closed after a failure: nothing to continue
            return
        self._ids += 1
        self._kept[self._ids] = (conv, time.monotonic())
        while len(self._kept) > self.limits.max_conversations or (
            len(self._kept) > 1 and sum(c.nbytes for c, _ in self._kept.values()) > self.limits.max_bytes
        ):
            self._drop(next(iter(self._kept)))

    def _drop(self, key: int) -> None:
        conv, _ = self._kept.pop(key)
        conv.close()

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, (_, used) in self._kept.items() if now - used > self.limits.idle_s]:
            self._drop(key)

    def stream(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        decode: str | Decoder,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
    ) -> Iterator[tuple[Generation, StepOutput, int]]:
        """Generate after `prompt` like `SplitClient.stream`; each item also says how many of the prompt's
        tokens an earlier request had already read (0: a fresh conversation)."""
        conv, held = self._take(prompt)
        try:
            for gen, out in conv.stream(list(prompt[held:]), max_new_tokens, decode, sampling, stop):
                yield gen, out, held
        finally:
            self._keep(conv)  # a generation stopped between steps is consistent: it may go on later

    def close(self) -> None:
        while self._kept:
            self._drop(next(iter(self._kept)))
