"""Where a model's files live and selective reads of its tensors.

A model is a Hugging Face folder (config.json + safetensors + tokenizer). GGUF files, the packaged
models among them (PACKAGED_MODELS: 'default', 'gemma3', the Qwen2.5-Coder pair), are converted once
into such a folder under the cache directory, so later starts read safetensors and each side maps only
the tensors it runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import math
import mmap
import os
import shutil
import struct
import tempfile
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from splitllm.model.config import ModelConfig
from splitllm.weights.packaged import DEFAULT_MODEL, PACKAGED_MODELS
from splitllm.progress import tracked

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

SOURCE_FILE = "source.json"  # in a converted folder: the name and sha256 of the .gguf it came from


def cache_root() -> Path:
    return Path(os.environ.get("SPLITLLM_CACHE", Path.home() / ".cache" / "splitllm"))


def _package_file(package: str, relative: str, install: str) -> Path:
    """A data file of an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"this model needs the package {package}: {install}")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed package {package}: {install}")
    return path


def packaged_gguf_path(alias: str) -> Path:
    """The GGUF of a packaged model; chunked ones are joined once under the cache and checked by sha256."""
    model = PACKAGED_MODELS[alias]
    parts = [_package_file(package, relative, model.install) for package, relative in model.parts]
    if len(parts) == 1:
        return parts[0]
    dest = cache_root() / "gguf" / model.name
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=dest.parent, prefix=".join-", delete=False) as out:
        tmp = Path(out.name)
        digest = hashlib.sha256()
        for part in tracked(parts, f"joining {model.name} (once)", len(parts)):
            with open(part, "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    digest.update(block)
                    out.write(block)
    if model.sha256 is not None and digest.hexdigest() != model.sha256:
        tmp.unlink()
        raise ValueError(f"the chunks of {model.name} join to the wrong sha256; reinstall them: {model.install}")
    tmp.rename(dest)
    return dest


def _file_digest(path: Path) -> str:
    """sha256 of a file, remembered per (path, size, mtime) so big weights are hashed once."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:32]
    memo = cache_root() / "digests" / key
    if memo.is_file():
        return memo.read_text().strip()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    digest = h.hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    memo.write_text(digest)
    return digest


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def convert_gguf(gguf: Path, dest: Path) -> None:
    """Dequantize a GGUF file into an HF folder (float32 safetensors), one tensor at a time.

    transformers supplies the config, the tokenizer, the GGUF -> HF tensor names and each
    architecture's tensor fix-ups; the weights stream from the GGUF into one shard per layer, so
    converting never holds more than a layer's float32 tensors (a 7B model converts in a few GiB).
    transformers' GGUF reader spends seconds a pass on a large vocabulary's strings, so the config
    comes from one read of the fields (loading the tokenizer reads them once more) and the tensors
    from the table alone.
    """
    from transformers import AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=dest.parent))
    try:
        fields = load_gguf_checkpoint(str(gguf), return_tensors=False)["config"]
        config = AutoConfig.for_model(**fields)  # as AutoConfig.from_pretrained(gguf_file=...) builds it
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch.float32  # what the shards hold
        shards = _write_gguf_shards(gguf, fields, config, tmp)
        weight_map = {name: file for file, names in shards.items() for name in names}
        index = {"metadata": {"format": "pt"}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        config.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


@dataclasses.dataclass(frozen=True)
class _GGUFTensor:
    """One tensor's entry in a GGUF file's table: where its bytes lie and how they are stored."""

    name: str
    shape: tuple[int, ...]  # outermost first, as torch orders it
    qtype: GGMLQuantizationType
    start: int  # from the start of the file
    nbytes: int


class _Cursor:
    """Reads a GGUF header's little-endian values in order, and steps over the fields it is not asked for."""

    def __init__(self, blob: mmap.mmap) -> None:
        from gguf import GGUFValueType as V

        self.blob, self.pos = blob, 0
        self.widths: dict[int, int] = {  # the fixed-size value types
            V.UINT8: 1, V.INT8: 1, V.BOOL: 1, V.UINT16: 2, V.INT16: 2, V.UINT32: 4, V.INT32: 4,
            V.FLOAT32: 4, V.UINT64: 8, V.INT64: 8, V.FLOAT64: 8,
        }

    def read(self, layout: str) -> tuple:
        values = struct.unpack_from(f"<{layout}", self.blob, self.pos)
        self.pos += struct.calcsize(f"<{layout}")
        return values

    def string(self) -> str:
        (length,) = self.read("Q")
        self.pos += length
        if self.pos > len(self.blob):
            raise struct.error("a string runs past the end of the file")
        return self.blob[self.pos - length : self.pos].decode()

    def skip(self, kind: int, count: int = 1) -> None:
        """Step over `count` values of the GGUFValueType `kind`."""
        from gguf import GGUFValueType as V

        if kind in self.widths:
            self.pos += self.widths[kind] * count
        elif kind == V.STRING:
            for _ in range(count):
                self.pos += 8 + self.read("Q")[0]
        elif kind == V.ARRAY:
            for _ in range(count):
                self.skip(*self.read("IQ"))
        else:
            raise ValueError(f"unknown GGUF value type {kind}")


def _gguf_table(path: Path) -> tuple[str, list[_GGUFTensor]]:
    """A GGUF file's architecture and tensor table (GGUF v2 and v3), its other fields stepped over.

    gguf's GGUFReader decodes every field into arrays, seconds a pass for a large vocabulary's
    strings; the table needs none of them.
    """
    from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
        header = _Cursor(blob)
        try:
            magic, version, tensor_count, field_count = header.read("IIQQ")
            if magic != GGUF_MAGIC or version not in (2, 3):
                raise ValueError("not a GGUF v2 or v3 file")
            architecture, alignment = "", GGUF_DEFAULT_ALIGNMENT
            for _ in range(field_count):
                key, (kind,) = header.string(), header.read("I")
                if key == "general.architecture":
                    architecture = header.string()
                elif key == "general.alignment":
                    (alignment,) = header.read("I")
                else:
                    header.skip(kind)
            entries = []
            for _ in range(tensor_count):
                name, (dims,) = header.string(), header.read("I")
                shape = tuple(reversed(header.read(f"{dims}Q")))
                stored, offset = header.read("IQ")
                qtype = GGMLQuantizationType(stored)
                block, size = GGML_QUANT_SIZES[qtype]
                entries.append((name, shape, qtype, offset, math.prod(shape) // block * size))
        except (struct.error, UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"{path} cannot be read as GGUF: {e}") from e
    data_start = -(-header.pos // alignment) * alignment
    return architecture, [_GGUFTensor(n, shape, q, data_start + offset, size) for n, shape, q, offset, size in entries]


def _dequantized(tensor: _GGUFTensor, file: BinaryIO) -> np.ndarray:
    """A GGUF tensor in float32, dequantized about 16 MiB at a time into its one output array.

    gguf's own dequantize keeps every row group's result until it concatenates them, so it holds
    twice the tensor: 1.9 GB for a 151936 x 1536 embedding, more than the rest of a conversion. The
    rows are read from `file`, never a memory map, whose pages would stay resident (the whole GGUF
    by the last tensor).
    """
    from gguf import dequantize

    out = np.empty(tensor.shape, dtype=np.float32)
    flat = out.reshape(-1, tensor.shape[-1])
    row_bytes = tensor.nbytes // len(flat)
    step = max(1, (1 << 22) // tensor.shape[-1])
    for start in range(0, len(flat), step):
        file.seek(tensor.start + start * row_bytes)
        rows = np.frombuffer(file.read(min(step, len(flat) - start) * row_bytes), np.uint8).reshape(-1, row_bytes)
        flat[start : start + len(rows)] = dequantize(rows, tensor.qtype)
    return out


def _write_gguf_shards(gguf: Path, fields: dict, config: PretrainedConfig, folder: Path) -> dict[str, list[str]]:
    """Each GGUF tensor dequantized, renamed and fixed up as transformers does, grouped into one
    safetensors file per layer and one per other tensor (an embedding or an LM head is the size of
    several layers); returns file -> tensor names. `fields` is the config transformers read from the
    file, which its tensor processors take."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    architecture, tensors = _gguf_table(gguf)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=fields)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)  # names only: no memory for weights
    names = get_gguf_hf_weights_map(skeleton, processor)
    wanted = set(skeleton.state_dict())
    if config.tie_word_embeddings:
        wanted.discard("lm_head.weight")
    del skeleton

    groups: dict[str, list[_GGUFTensor]] = {}
    for tensor in tensors:
        key = tensor.name.split(".")[1] if tensor.name.startswith("blk.") else tensor.name
        groups.setdefault(key, []).append(tensor)
    # where processors that split tensors (mixtures of experts) leave them
    parsed: dict[str, dict[str, torch.Tensor]] = {"tensors": {}}

    def write_shard(group: list[_GGUFTensor], source: BinaryIO, path: Path) -> list[str]:
        """Dequantize, rename and save one group; a function, so its tensors are freed before the next."""
        out: dict[str, torch.Tensor] = {}
        for tensor in group:
            result = processor.process(
                weights=_dequantized(tensor, source), name=tensor.name,
                tensor_key_mapping=names, parsed_parameters=parsed,
            )
            if names.get(result.name) in wanted:
                out[names[result.name]] = torch.from_numpy(np.ascontiguousarray(result.weights, dtype=np.float32))
        out.update({k: v.float().contiguous() for k, v in parsed["tensors"].items() if k in wanted})
        parsed["tensors"].clear()
        if out:
            save_file(out, path, metadata={"format": "pt"})
        return list(out)

    shards: dict[str, list[str]] = {}
    with open(gguf, "rb") as source:
        for i, group in enumerate(tracked(groups.values(), f"converting {gguf.name} (once)", len(groups))):
            file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            if saved := write_shard(group, source, folder / file):
                shards[file] = saved
    return shards


def resolve_model(spec: str | os.PathLike | None) -> Path:
    """Turn a model argument (a PACKAGED_MODELS alias, an HF folder, a .gguf file) into an HF folder path."""
    if spec is None:
        spec = DEFAULT_MODEL
    if str(spec) in PACKAGED_MODELS:
        spec = packaged_gguf_path(str(spec))
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
        return path
    if path.is_file() and path.suffix == ".gguf":
        dest = cache_root() / "models" / f"{path.stem}-{_file_digest(path)[:16]}"
        if not (dest / "config.json").is_file():
            dest.parent.mkdir(parents=True, exist_ok=True)
            convert_gguf(path, dest)
        if not (dest / SOURCE_FILE).is_file():
            _write_atomic(dest / SOURCE_FILE, json.dumps({"file": path.name, "sha256": _file_digest(path)}))
        return dest
    raise FileNotFoundError(f"model {spec!s} is neither an HF folder nor a .gguf file")


def default_draft_model(files: ModelFiles) -> str | None:
    """The packaged model that drafts for these weights by default (`PackagedGGUF.draft_model`), when
    they are a packaged model's and the draft model's packages are installed."""
    if not (files.path / SOURCE_FILE).is_file():
        return None  # not converted from a GGUF, so no packaged model (and no hashing of its weights)
    for packaged in PACKAGED_MODELS.values():
        if packaged.draft_model and packaged.sha256 and files.sources == [(packaged.name, packaged.sha256)]:
            parts = PACKAGED_MODELS[packaged.draft_model].parts
            return packaged.draft_model if all(importlib.util.find_spec(p) for p, _ in parts) else None
    return None


class ModelFiles:
    """An HF model folder: config, fingerprint, and per-tensor reads that touch only what is asked."""

    def __init__(self, spec: str | os.PathLike | None) -> None:
        self.path = resolve_model(spec)

    @cached_property
    def hf_config(self) -> PretrainedConfig:
        return AutoConfig.from_pretrained(self.path)

    @cached_property
    def config(self) -> ModelConfig:
        return ModelConfig.from_hf(self.hf_config)

    @cached_property
    def _tensor_files(self) -> dict[str, Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: self.path / f for name, f in weight_map.items()}
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no safetensors weights in {self.path}")
        names: dict[str, Path] = {}
        for f in files:
            with safe_open(f, framework="pt") as st:
                names.update({k: f for k in st.keys()})
        return names

    @cached_property
    def fingerprint(self) -> str:
        """Identity of the exact weights and the math over them, the same on any library release.

        It hashes the source weight files (the .gguf a folder was converted from, or an HF folder's
        safetensors, whose headers hold every tensor's name, shape and dtype) and our own ModelConfig
        (the fields that define the decoder math), never the converted tensors nor transformers'
        config dict (which carries its version and defaults that vary between releases). It names the
        model so two sides can match (`open`, drafters), taking a conversion's source.json and digests
        remembered by file size and time on trust; what a server proves it loaded is the loaded-weights
        fingerprint (weights/loaded.py).
        """
        math = json.dumps(dataclasses.asdict(self.config), sort_keys=True)
        h = hashlib.sha256(b"splitllm-fingerprint-2\n" + math.encode())
        for name, digest in self.sources:
            h.update(f"{name}\0{digest}\n".encode())
        return h.hexdigest()

    @cached_property
    def sources(self) -> list[tuple[str, str]]:
        """(file name, sha256) of each source weight file."""
        marker = self.path / SOURCE_FILE
        if marker.is_file():
            source = json.loads(marker.read_text())
            return [(source["file"], source["sha256"])]
        return [(f.name, _file_digest(f)) for f in sorted(set(self._tensor_files.values()))]

    def has(self, name: str) -> bool:
        return name in self._tensor_files

    def file_of(self, name: str) -> Path:
        """The safetensors file that holds tensor `name`."""
        if name not in self._tensor_files:
            raise KeyError(f"tensor {name} not found in {self.path}")
        return self._tensor_files[name]

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensor_files)

    @property
    def weight_files(self) -> list[Path]:
        return sorted(set(self._tensor_files.values()))

    def read(self, names: Iterable[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Read only the named tensors, converted to dtype."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            if name not in self._tensor_files:
                raise KeyError(f"tensor {name} not found in {self.path}")
            by_file.setdefault(self._tensor_files[name], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for f, wanted in by_file.items():
            with safe_open(f, framework="pt") as st:
                for name in wanted:
                    out[name] = st.get_tensor(name).to(dtype)
        return out
