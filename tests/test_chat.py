"""Conversations: later turns reuse the KV caches (the server sees each position once), their answers
match a fresh prefill of the same tokens, and the terminal chat's commands work."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from rich.console import Console

from splitllm.api.terminal_chat import run_chat
from splitllm.client.client import SplitClient

from conftest import CHAT_CASES

TURNS = ["My name is Ada.", "What is my name?", "Say it backwards."]


class PositionLog:
    """The server's middle stage, recording the positions of every step it computes."""

    def __init__(self, stage: Any) -> None:
        self.stage, self.steps = stage, []

    def forward_many(self, batch: list[Any]) -> list[torch.Tensor]:
        self.steps.extend(step.positions.tolist() for _, step in batch)  # (cache, step) pairs
        return self.stage.forward_many(batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stage, name)


@pytest.fixture(scope="module", params=CHAT_CASES)
def split(request, chat_split) -> tuple[str | None, int, int]:  # type: ignore[no-untyped-def]
    """(model, first, last) of the model the chat runs on."""
    return chat_split(request.param)


def test_turns_send_the_server_only_new_positions(server, split,  # type: ignore[no-untyped-def]
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    thread = server(*split)
    log = PositionLog(thread.server.stage)
    monkeypatch.setattr(thread.server.steps, "stage", log)  # where the server runs its forwards
    client = SplitClient(split[0], thread.url, first=split[1], last=split[2])
    with client.conversation() as conv:
        for question in TURNS:
            before, first_step = len(conv.ids), len(log.steps)
            gen = None
            for gen, _ in conv.say(question, max_new_tokens=12, decode="sequential"):  # noqa: B007 (the last step)
                pass
            assert gen is not None and gen.ids
            # The turn's first step: the previous answer's last token, then the new template tokens.
            start = max(before - 1, 0)
            assert log.steps[first_step] == list(range(start, start + len(gen.prompt_ids) + (before > 0)))
            assert len(log.steps) - first_step == len(gen.steps)
        processed = [p for step in log.steps for p in step]
        assert processed == list(range(len(conv.ids) - 1))  # every position once, in order: no re-prefill
        assert [m["role"] for m in conv.messages] == ["user", "assistant"] * 3


@pytest.fixture(scope="module")
def client(split: tuple[str | None, int, int]) -> SplitClient:
    """The model with its middle layers in-process."""
    return SplitClient(split[0], first=split[1], last=split[2])


@pytest.mark.parametrize("decode", ["sequential", "auto"])
def test_continued_turn_equals_a_fresh_prefill(client: SplitClient, decode: str) -> None:
    with client.conversation() as conv:
        for question in TURNS[:2]:
            for _ in conv.say(question, max_new_tokens=10, decode=decode):
                pass
        history = list(conv.ids)
        third = [gen for gen, _ in conv.say(TURNS[2], max_new_tokens=10, decode=decode)][-1]
    fresh = client.generate(history + third.prompt_ids, 10, decode)
    assert third.ids == fresh.ids


def test_terminal_chat_commands(client: SplitClient) -> None:
    lines = iter(["Hello!", "/stats", "What did I say?", "/nope", "/reset", "/stats", "/quit", "never read"])
    out = io.StringIO()
    run_chat(client, max_new_tokens=8, read=lambda _prompt: next(lines), console=Console(file=out, width=120))
    text = out.getvalue()
    assert text.count(" tok/s · ") == 2 and text.count(" tok/step · RTT ") == 2  # one status line a turn
    assert "turns of this conversation" in text and "unknown command /nope" in text
    assert "[conversation reset]" in text and "no turns yet" in text
    assert next(lines) == "never read"
