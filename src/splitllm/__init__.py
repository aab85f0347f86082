"""LLM inference split between a device and a server; confidential with an attested server (docs/confidential.md).

The public classes load lazily, so `import splitllm` (and the server, which needs none of them)
stays free of the tokenizer and model imports.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SplitClient": "splitllm.client.client",
    "SamplingParams": "splitllm.decoding.sampling",
    "SplitModelForCausalLM": "splitllm.api.hf",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'splitllm' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
