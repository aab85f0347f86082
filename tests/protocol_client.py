"""Clients for tests: a bare protocol client that sends any frame (typed messages, hostile header maps
or bytes) and reads every reply as a typed message, and greedy decoding through any middle with a hook
between steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from splitllm.protocol import messages, wire
from splitllm.protocol.messages import CloseMessage, OpenMessage, Reply, Request, StepMessage
from splitllm.client.connection import ConnectionOptions
from splitllm.client.client_model import ClientModel
from splitllm.client.pipeline import Middle, SplitPipeline
from splitllm.client.remote import RemoteMiddle
from splitllm.decoding.sampling import Sampler, SamplingParams
from splitllm.decoding.sequential import decode_sequential
from splitllm.model.visibility import Visibility
from splitllm.weights.sources import ModelFiles


class RawClient:
    """One WebSocket connection to a server; nothing is checked or retried."""

    def __init__(self, url: str, options: ConnectionOptions | None = None) -> None:
        self.ws = (options or ConnectionOptions()).connect(url.rstrip("/") + "/ws")

    def send_raw(self, message: bytes | str, timeout: float = 30) -> Reply:
        """Any bytes (or text); the server's reply, decoded and checked like a client's."""
        self.ws.send(message)
        return messages.decode(self.ws.recv(timeout=timeout), messages.REPLIES)

    def request(self, header: dict[str, Any], tensor: torch.Tensor | None = None, dtype: str = "float32") -> Reply:
        """A header map as it is, malformed or not, framed with `tensor`."""
        return self.send_raw(wire.encode(header, tensor, dtype))

    def send(self, message: Request) -> Reply:
        return self.send_raw(messages.encode(message))

    def open(self, files: ModelFiles, layers: tuple[int, int], max_context: int = 64, dtype: str = "float32") -> Reply:
        return self.send(OpenMessage(files.fingerprint, layers, dtype, max_context))

    def step(
        self, session: str, hidden: torch.Tensor, positions: list[int], keep: list[int], vis: Visibility | None = None
    ) -> Reply:
        """A float32 step; `vis` None: a chain (no visibility fields)."""
        parents, bits = (None, None) if vis is None else vis.to_wire()
        return self.send(StepMessage(session, hidden, "float32", tuple(positions), tuple(keep), parents, bits))

    def close_session(self, session: str) -> Reply:
        return self.send(CloseMessage(session))

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
    client_model: ClientModel,
    middle: Middle,
    prompt: list[int],
    max_new_tokens: int,
    after_token: Callable[[int], None] | None = None,
) -> list[int]:
    """Greedy ids of the split model through `middle` (closed at the end); `after_token(count)` runs
    between steps, where tests break links or restart servers."""
    pipeline = SplitPipeline(client_model, middle, len(prompt) + max_new_tokens)
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
