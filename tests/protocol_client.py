"""Clients for tests: a bare protocol client that sends any frame (well-formed or hostile), and greedy
decoding through any middle with a hook between steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from splitllm.protocol import wire
from splitllm.client.connection import ConnectionOptions
from splitllm.client.client_model import LocalModel
from splitllm.client.pipeline import Middle, SplitPipeline
from splitllm.client.remote import RemoteMiddle
from splitllm.decoding.sampling import Sampler, SamplingParams
from splitllm.decoding.sequential import decode_sequential
from splitllm.weights.sources import ModelFiles


class RawClient:
    """One WebSocket connection to a server; nothing is checked or retried."""

    def __init__(self, url: str, options: ConnectionOptions | None = None) -> None:
        self.ws = (options or ConnectionOptions()).connect(url.rstrip("/") + "/ws")

    def send_raw(self, message: bytes | str, timeout: float = 30) -> wire.Frame:
        self.ws.send(message)
        return wire.decode(self.ws.recv(timeout=timeout))

    def request(self, header: dict[str, Any], tensor: torch.Tensor | None = None, dtype: str = "float32") -> wire.Frame:
        return self.send_raw(wire.encode(header, tensor, dtype))

    def open(self, files: ModelFiles, layers: tuple[int, int], max_context: int = 64, dtype: str = "float32") -> wire.Frame:
        return self.request(
            {
                "op": "open",
                "version": wire.PROTOCOL_VERSION,
                "fingerprint": files.fingerprint,
                "layers": list(layers),
                "dtype": dtype,
                "max_context": max_context,
            }
        )

    def step(
        self, session: str, hidden: torch.Tensor, positions: list[int], keep: list[int], **fields: Any
    ) -> wire.Frame:
        header = {"op": "step", "session": session, "positions": positions, "keep": keep, **fields}
        return self.request(header, hidden)

    def close(self) -> None:
        self.ws.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def seeded_greedy() -> Sampler:
    """Greedy choice that leaves the global `random` state alone (hypothesis checks it between examples)."""
    return Sampler(SamplingParams(seed=0))


def greedy(
    local: LocalModel,
    middle: Middle,
    prompt: list[int],
    max_new_tokens: int,
    after_token: Callable[[int], None] | None = None,
) -> list[int]:
    """Greedy ids of the split model through `middle` (closed at the end); `after_token(count)` runs
    between steps, where tests break links or restart servers."""
    pipeline = SplitPipeline(local, middle, len(prompt) + max_new_tokens)
    ids: list[int] = []
    try:
        for out in decode_sequential(pipeline, prompt, max_new_tokens, frozenset(), seeded_greedy()):
            ids.extend(out.tokens)
            if after_token is not None:
                after_token(len(ids))
    finally:
        if isinstance(middle, RemoteMiddle):
            middle.close()
    return ids
