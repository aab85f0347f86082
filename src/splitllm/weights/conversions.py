"""A model's tensors in the form one precision runs them: 16-bit or quantized, converted once.

The exact mode (float32 or float64, no quantization) reads the model folder itself. Any other
precision keeps its own copy under the cache directory, one safetensors file per layer (and one each for the
embedding, final norm and LM head), each written the first time a side asks for one of its tensors: a side
converts only the layers it runs, and conversion holds one layer in memory at a time.
"""

from __future__ import annotations

import hashlib
import re
import tempfile
from functools import cached_property
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from splitllm.model import quant
from splitllm.model.precision import Precision
from splitllm.weights.sources import ModelFiles, cache_root
from splitllm.progress import working

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_PART = "::"  # a linear weight's stored parts are kept as "<name>::<part>"
STORED_FORM = 2  # bumped when a stored part changes meaning (2: int4 as float16 scales and minimums)


def _is_linear(name: str, quantized: bool) -> bool:
    """A tied LM head is the embedding: its own (quantized) copy is kept only when it differs from the table."""
    return name.endswith("proj.weight") or name == "lm_head.weight" or (quantized and name == "model.embed_tokens.weight")


def _is_dense(name: str) -> bool:
    return not name.endswith("proj.weight") and name != "lm_head.weight"


def _group(name: str) -> str:
    """A layer's tensors share a file; every other tensor (embedding, final norm, LM head) has its own, so
    converting a 150k-row embedding never holds the LM head too."""
    match = _LAYER.match(name)
    return f"layer-{int(match.group(1)):04d}" if match else name


class StoredWeights:
    """Reads of a model's tensors in one precision: dense tensors and linear weights' stored parts."""

    def __init__(self, files: ModelFiles, precision: Precision) -> None:
        self.files, self.precision = files, precision

    @cached_property
    def folder(self) -> Path:
        """Where this precision's files live: keyed by the stored form, the source folder and its files'
        sizes and times, so replaced weights (or a changed form) convert again."""
        h = hashlib.sha256(f"{STORED_FORM}|{self.files.path.resolve()}".encode())
        for f in self.files.weight_files:
            st = f.stat()
            h.update(f"{f.name}|{st.st_size}|{st.st_mtime_ns}".encode())
        return cache_root() / "stored" / f"{self.files.path.name}-{h.hexdigest()[:16]}" / self.precision.name

    def dense(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Norms, biases and the embedding table on the CPU, as stored: callers finish them with
        `Precision.dense`. Vectors stay float32 (they are tiny, and a loader may still adjust them
        before rounding); the embedding table is kept in the compute dtype."""
        if self.precision.exact:
            return self.files.read(names, self.precision.dtype)
        return {n: self._read(n) for n in names}

    def linear(self, names: list[str], bias: list[str] | None = None) -> torch.nn.Module:
        """One linear module computing the named weights (and biases) fused along their outputs."""
        if self.precision.exact:
            parts = [{"weight": w} for w in self.files.read(names, self.precision.dtype).values()]
        else:
            parts = [self._linear_parts(n) for n in names]
        stored = quant.fuse(parts)
        fused_bias = torch.cat(list(self.dense(bias).values())) if bias else None
        return self.precision.linear(stored, fused_bias)

    def _linear_parts(self, name: str) -> dict[str, torch.Tensor]:
        path = self._file(name)
        prefix = name + _PART
        with safe_open(path, framework="pt") as st:
            return {k.removeprefix(prefix): st.get_tensor(k) for k in st.keys() if k.startswith(prefix)}

    def _read(self, name: str) -> torch.Tensor:
        with safe_open(self._file(name), framework="pt") as st:
            return st.get_tensor(name)

    def _file(self, name: str) -> Path:
        if not self.files.has(name):
            raise KeyError(f"tensor {name} not found in {self.files.path}")
        group = _group(name)
        path = self.folder / f"{group}.safetensors"
        if not path.is_file():
            self._convert(group, path)
        return path

    def _convert(self, group: str, path: Path) -> None:
        """Write one group's tensors in this precision (atomically: a concurrent reader sees all or nothing)."""
        names = [n for n in self.files.tensor_names if _group(n) == group]
        out: dict[str, torch.Tensor] = {}
        with working(f"storing {self.files.path.name}'s {group} in {self.precision.name} (once)"):
            for name, w in self.files.read(names, torch.float32).items():
                if _is_dense(name):
                    out[name] = (w if w.dim() == 1 else w.to(self.precision.dtype)).contiguous()
                if _is_linear(name, self.precision.quant != "none") and w.dim() == 2:
                    out.update({f"{name}{_PART}{k}": v.contiguous() for k, v in self.precision.store_linear(w).items()})
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as tmp:
                pass
            save_file(out, tmp.name, metadata={"format": "pt", "precision": self.precision.name})
        Path(tmp.name).replace(path)
