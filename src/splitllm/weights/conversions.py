"""A model's tensors in the form one precision runs them: 16-bit or quantized, converted once.

The exact mode (float32 or float64, no quantization) reads the model folder itself. Any other
precision keeps its own copy under the cache directory, one safetensors file per layer (and one each for the
embedding, final norm and LM head), each written the first time a side asks for one of its tensors: a side
converts only the layers it runs, and conversion holds one layer in memory at a time. Either way, the files
a load builds its tensors from are read whole and hashed as they are read (weights/loaded.py).
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path

import torch
from safetensors.torch import save

from splitllm.model import quant
from splitllm.model.precision import Precision
from splitllm.weights.loaded import read_safetensors
from splitllm.weights.sources import ModelFiles, cache_root
from splitllm.progress import working

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_PART = "::"  # a linear weight's stored parts are kept as "<name>::<part>"
# Bumped when a stored part changes meaning or a file's bytes change form (2: int4 as float16 scales and
# minimums; 3: headers written canonically, `_canonical`).
STORED_FORM = 3


def _is_linear(name: str, quantized: bool) -> bool:
    """A tied LM head is the embedding: its own (quantized) copy is kept only when it differs from the table."""
    return (
        name.endswith("proj.weight") or name == "lm_head.weight" or (quantized and name == "model.embed_tokens.weight")
    )


def _is_dense(name: str) -> bool:
    return not name.endswith("proj.weight") and name != "lm_head.weight"


def _group(name: str) -> str:
    """A layer's tensors share a file; every other tensor (embedding, final norm, LM head) has its own, so
    converting a 150k-row embedding never holds the LM head too."""
    match = _LAYER.match(name)
    return f"layer-{int(match.group(1)):04d}" if match else name


class StoredWeights:
    """Reads of a model's tensors in one precision: dense tensors and linear weights' stored parts.

    `names`: every checkpoint tensor the caller takes, each once. Each file is read once, whole, and
    hashed as it is read (`digests`: file name -> SHA-256); the named tensors are kept from that read
    until taken, so a file holding several layers is read once for all of them and nothing else of it
    stays in memory.
    """

    def __init__(self, files: ModelFiles, precision: Precision, names: Iterable[str]) -> None:
        self.files, self.precision = files, precision
        self._names = set(names)
        for name in sorted(self._names):
            if not files.has(name):
                raise KeyError(f"tensor {name} not found in {files.path}")
        self._held: dict[str, torch.Tensor] = {}  # read, not yet taken
        self.digests: dict[str, str] = {}

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
            return {n: self._take(n, self.files.file_of(n))[n].to(self.precision.dtype) for n in names}
        return {n: self._take(n, self._file(n))[n] for n in names}

    def linear(self, names: list[str], bias: list[str] | None = None) -> torch.nn.Module:
        """One linear module computing the named weights (and biases) fused along their outputs."""
        if self.precision.exact:
            parts = [{"weight": self._take(n, self.files.file_of(n))[n].to(self.precision.dtype)} for n in names]
        else:
            parts = [self._linear_parts(n) for n in names]
        stored = quant.fuse(parts)
        fused_bias = torch.cat(list(self.dense(bias).values())) if bias else None
        return self.precision.linear(stored, fused_bias)

    def _linear_parts(self, name: str) -> dict[str, torch.Tensor]:
        prefix = name + _PART
        return {k.removeprefix(prefix): v for k, v in self._take(name, self._file(name), prefix).items()}

    def _take(self, name: str, path: Path, prefix: str | None = None) -> dict[str, torch.Tensor]:
        """`name` (with `prefix`: its stored parts, the keys starting with it) from `path`, which this load
        reads once, keeping every tensor it was told it takes."""
        if name not in self._names:
            raise KeyError(f"{name} is not among the tensors this load was told it takes")
        if path.name not in self.digests:
            tensors, self.digests[path.name] = read_safetensors(path, lambda k: k.partition(_PART)[0] in self._names)
            self._held.update(tensors)
        keys = [k for k in self._held if (k.startswith(prefix) if prefix else k == name)]
        if not keys:
            raise KeyError(f"{path} holds no {name}, or this load took it already")
        return {k: self._held.pop(k) for k in keys}

    def _file(self, name: str) -> Path:
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
                tmp.write(_canonical(save(out, metadata={"format": "pt", "precision": self.precision.name})))
        Path(tmp.name).replace(path)


def _canonical(data: bytes) -> bytes:
    """A safetensors file with its header's keys sorted. safetensors writes the metadata in a hash map's
    order, which differs from one process to the next, and a converted file's bytes must be a function of
    its tensors alone: the loaded-weights fingerprint hashes them, and `splitllm attest weights` on the
    policy writer's machine must get the server's value. Same length, so the data offsets hold."""
    size = int.from_bytes(data[:8], "little")
    header = json.dumps(json.loads(data[8 : 8 + size]), sort_keys=True, separators=(",", ":")).encode()
    if len(header) > size:
        raise ValueError("a canonical safetensors header came out longer than the one written")
    return data[:8] + header.ljust(size) + data[8 + size :]
