"""What a load holds, named by the bytes it was made from: the loaded-weights fingerprint.

A load (`StoredWeights`) reads each weight file it needs whole, front to back, into memory, hashing
every byte as it arrives, and builds its tensors from those same bytes: nothing is mapped, no digest
is remembered by file size or time, and no file's own account of where it came from (a converted
folder's source.json) is taken. The files are the checkpoint's safetensors in the exact mode, and
the precision's converted files otherwise (weights/conversions.py), since those are what become the
tensors. The fingerprint of layers [start, end) is

    SHA-256 of the UTF-8 JSON (keys sorted, separators "," and ":") of
        {"format": "splitllm-loaded-weights-1",
         "config": the ModelConfig the layers compute with (dataclasses.asdict),
         "layers": [start, end],
         "precision": the stored form's name, e.g. "bfloat16-int8" (the device is no part of it),
         "files": [[file name, SHA-256 hex of the file's bytes], ...] sorted by file name}

so each file's entry is what `sha256sum` prints for it. A confidential server binds its middle's
fingerprint into every attestation report; anyone holding the same model computes the value a policy
expects with `splitllm attest weights` (docs/confidential.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from splitllm.model.config import ModelConfig

FORMAT = "splitllm-loaded-weights-1"
_BLOCK = 1 << 22  # bytes per read call, each hashed as soon as it arrives
_MAX_HEADER = 100 << 20  # the largest header safetensors itself accepts
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


def loaded_fingerprint(config: ModelConfig, layers: tuple[int, int], precision: str, files: Mapping[str, str]) -> str:
    """The fingerprint of a load of `layers` in `precision` from `files` (file name -> SHA-256 hex)."""
    document = {
        "format": FORMAT,
        "config": dataclasses.asdict(config),
        "layers": list(layers),
        "precision": precision,
        "files": [[name, files[name]] for name in sorted(files)],
    }
    return hashlib.sha256(json.dumps(document, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class _HashedReader:
    """A file read once from its start, every byte hashed as it is read."""

    def __init__(self, file: io.BufferedIOBase, path: Path) -> None:
        self.file, self.path = file, path
        self.sha256 = hashlib.sha256()
        self._scratch = memoryview(bytearray(_BLOCK))

    def into(self, buffer: memoryview) -> None:
        """Fill `buffer` with the next bytes of the file."""
        done = 0
        while done < len(buffer):
            n = self.file.readinto(buffer[done : done + _BLOCK])
            if not n:
                raise ValueError(f"{self.path} ends before its safetensors header says it does")
            self.sha256.update(buffer[done : done + n])
            done += n

    def skip(self, count: int) -> None:
        """Read (and hash) `count` bytes nobody keeps."""
        while count > 0:
            n = min(count, _BLOCK)
            self.into(self._scratch[:n])
            count -= n

    def rest(self) -> None:
        """Read (and hash) whatever follows, to the end of the file."""
        while n := self.file.readinto(self._scratch):
            self.sha256.update(self._scratch[:n])


def _entry(path: Path, name: str, spec: Any) -> tuple[int, int, str, torch.dtype, list[int]]:
    """(begin, end, name, dtype, shape) of one tensor of a safetensors header, checked for consistency."""
    try:
        dtype = _DTYPES[spec["dtype"]]
        shape = [int(d) for d in spec["shape"]]
        begin, end = (int(o) for o in spec["data_offsets"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: the header's entry for {name} is malformed ({type(exc).__name__}: {exc})") from None
    if min(shape, default=0) < 0 or not 0 <= begin <= end or end - begin != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"{path}: the header's offsets for {name} do not fit its shape and dtype")
    return begin, end, name, dtype, shape


def read_safetensors(path: Path, keep: Callable[[str], bool]) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors of a safetensors file that `keep` picks, and the SHA-256 of the whole file, from one read.

    The kept tensors are read into their own memory in the same pass that hashes them, so the digest
    names exactly the bytes they hold: a file edited or replaced while it is loaded cannot give the
    tensors one content and the digest another. Nothing else of the file stays in memory.
    """
    with open(path, "rb") as file:
        reader = _HashedReader(file, path)
        size = bytearray(8)
        reader.into(memoryview(size))
        header_size = int.from_bytes(size, "little")
        if header_size > _MAX_HEADER:
            raise ValueError(f"{path} is not a safetensors file (a header of {header_size} bytes)")
        raw = bytearray(header_size)
        reader.into(memoryview(raw))
        try:
            header = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"{path} is not a safetensors file ({exc})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{path} is not a safetensors file (its header is not a JSON object)")
        entries = sorted(_entry(path, n, s) for n, s in header.items() if n != "__metadata__" and keep(n))
        tensors: dict[str, torch.Tensor] = {}
        position = 0
        for begin, end, name, dtype, shape in entries:
            if begin < position:
                raise ValueError(f"{path}: {name} overlaps the tensor before it")
            reader.skip(begin - position)
            data = bytearray(end - begin)
            reader.into(memoryview(data))
            tensors[name] = torch.frombuffer(data, dtype=dtype).reshape(shape) if data else torch.empty(shape,
                                                                                                        dtype=dtype)
            position = end
        reader.rest()
    return tensors, reader.sha256.hexdigest()
