"""Every table of measured figures in the docs is generated from a committed result: JSON that says when,
on which commit and CPU, and by which command it was measured, and the doc's block equals what that
JSON renders (`splitllm bench ... --publish` writes both)."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from splitllm.lab import results
from splitllm.lab.bench import confidential, conversation, kernels, speculation, structured, suffix

PUBLISHED: dict[str, tuple[str, Callable[[dict], str]]] = {  # result -> (the doc showing it, its renderer)
    "confidential": ("confidential.md", confidential.markdown),
    "conversation": ("usage.md", conversation.markdown),
    "structured": ("usage.md", structured.markdown),
    "speculation": ("drafting.md", speculation.report),
    "kernels": ("precision.md", kernels.markdown),
    "speculation-avx2": ("drafting.md", speculation.report),  # the same, measured on a CPU without AVX-512
    "kernels-avx2": ("precision.md", kernels.markdown),
    "suffix": ("drafting.md", suffix.markdown),
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_a_docs_table_is_generated_from_its_published_result(name: str) -> None:
    doc, render = PUBLISHED[name]
    published = json.loads((results.RESULTS / f"{name}.json").read_text())
    assert {"date", "git_commit", "cpu", "command"} <= published["provenance"].keys()
    assert published["provenance"]["command"].startswith(f"splitllm bench {name.partition('-')[0]}")
    assert results.block((results.CHECKOUT / "docs" / doc).read_text(), name) == render(published)
