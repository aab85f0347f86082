"""Reading tool calls out of a growing answer: what streams as content, what comes back as calls."""

from __future__ import annotations

from splitllm.api.tools import ToolCallReader

TAGGED = ('Let me look.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
          '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')


def _read(text: str, names: tuple[str, ...] = ("f", "g"), piece: int = 5) -> tuple[str, list[tuple[str, str]],
                                                                                   ToolCallReader]:
    """Feed `text` as a stream would, `piece` characters at a time: the content given out and the calls."""
    reader, content, calls = ToolCallReader(names), "", []
    for end in [*range(piece, len(text), piece), len(text)]:
        delta, new = reader.feed(text[:end], end == len(text))
        content += delta
        calls += [(c.name, c.arguments) for c in new]
    return content, calls, reader


def test_tagged_calls_stream_as_they_close_after_the_content_before_them() -> None:
    content, calls, reader = _read(TAGGED)
    assert content == "Let me look.\n" and calls == [("f", '{"a": 1}'), ("g", "{}")]
    assert reader.content(TAGGED) == "Let me look."


def test_a_fenced_call_object_to_an_offered_tool_is_a_call_and_anything_else_is_content() -> None:
    fenced = '```json\n{"name": "f", "arguments": {"city": "Paris"}}\n```'
    content, calls, reader = _read(fenced)
    assert content == "" and calls == [("f", '{"city": "Paris"}')] and reader.content(fenced) is None
    for text in ('```json\n{"name": "h", "arguments": {}}\n```',  # not an offered tool
                 '{"answer": 42}',  # not a call
                 "Plain <tool_call> that never closes",
                 "<tool_call>\n{not json}\n</tool_call>"):
        content, calls, reader = _read(text)
        assert content == text and calls == [] and reader.content(text) == text, text


def test_text_that_may_open_a_call_is_held_back_until_it_cannot() -> None:
    reader = ToolCallReader(["f"])
    assert reader.feed("Sure <tool", False) == ("Sure ", [])  # "<tool" may become "<tool_call>"
    assert reader.feed("Sure <tooling> helps", False) == ("<tooling> helps", [])
