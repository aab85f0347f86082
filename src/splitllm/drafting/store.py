"""Drafters on disk: a folder of weights plus metadata, bound to one target model by its fingerprint.

A drafter folder holds `drafter.safetensors` (fc, the decoder layer and the draft vocabulary; matrices in half
precision, or int8 with one scale per row where a drafter must stay small) and `drafter.json` (what it was
trained for, on what, how well it drafts, how to rebuild it).
Drafters shipped with the package live under `splitllm/drafting/drafters/<name>/` and are found by the
fingerprint of the loaded model, the way the default model is found without a training step.
A drafter only ever proposes: a wrong one costs speed, never correctness, but one trained for other
weights would only waste round trips, so it is refused.
"""

from __future__ import annotations

import json
from importlib.resources import files as package_files
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from splitllm.drafting.drafter import Drafter, check_taps, drafter_config
from splitllm.model.quant import Int8Linear
from splitllm.weights.sources import ModelFiles

WEIGHTS = "drafter.safetensors"
METADATA = "drafter.json"
FINGERPRINT_KEY = "target_fingerprint"
WEIGHT_FORMATS = ("float16", "int8")
_SCALE = ".int8_scale"  # suffix of the per-row scales of an int8 matrix stored under its own name


def shipped_drafters_root() -> Path:
    """Where the package keeps its trained drafters (one folder per target model)."""
    return Path(str(package_files("splitllm.drafting") / "drafters"))


def _stored(tensors: dict[str, torch.Tensor], weights: str) -> dict[str, torch.Tensor]:
    """Tensors as written: matrices in float16 or int8 with per-row scales, vectors in float16, ids as int32."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        t = t.detach()
        if not t.is_floating_point():
            out[name] = t.to(torch.int32).contiguous()
        elif weights == "int8" and t.dim() == 2:
            q = Int8Linear.quantize(t)
            out[name], out[name + _SCALE] = q["q"].contiguous(), q["scales"].to(torch.float16).contiguous()
        else:
            out[name] = t.to(torch.float16).contiguous()
    return out


def _loaded(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `_stored`: int8 matrices times their scales, in float32."""
    return {
        name: t.float() * tensors[name + _SCALE].float()[:, None] if name + _SCALE in tensors else t
        for name, t in tensors.items()
        if not name.endswith(_SCALE)
    }


def save_drafter(drafter: Drafter, folder: str | Path, metadata: dict[str, Any], weights: str = "float16") -> Path:
    """Write `drafter` (matrices in `weights`: float16 or int8) and its metadata; metadata must name the
    target's fingerprint."""
    if not metadata.get(FINGERPRINT_KEY):
        raise ValueError(f"drafter metadata needs the target model's fingerprint under {FINGERPRINT_KEY!r}")
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"drafter weights are stored as one of {', '.join(WEIGHT_FORMATS)}, not {weights!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(_stored(drafter.state_dict(), weights), folder / WEIGHTS, metadata={"format": "pt"})
    meta = {
        **metadata,
        "taps": list(drafter.taps),
        "intermediate_size": drafter.cfg.intermediate_size,
        "draft_vocab": int(drafter.vocab.numel()),
        "weights_dtype": weights,
        "parameters": sum(int(t.numel()) for name, t in drafter.state_dict().items() if name != "vocab"),
        "size_bytes": (folder / WEIGHTS).stat().st_size,
    }
    (folder / METADATA).write_text(json.dumps(meta, indent=1) + "\n")
    return folder


def read_metadata(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / METADATA
    if not path.is_file():
        raise ValueError(f"{folder} is not a drafter folder: it has no {METADATA}")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(meta, dict) or not isinstance(meta.get(FINGERPRINT_KEY), str):
        raise ValueError(f"{path} does not name the target model's fingerprint ({FINGERPRINT_KEY})")
    return meta


def _build(files: ModelFiles, folder: Path, meta: dict[str, Any], dtype: torch.dtype) -> Drafter:
    """Rebuild the drafter from its folder, unpacked; shapes are checked against the target's config."""
    weights_path = folder / WEIGHTS
    if not weights_path.is_file():
        raise ValueError(f"{folder} has {METADATA} but no {WEIGHTS}")
    tensors = _loaded(load_file(weights_path))
    if "vocab" not in tensors:
        raise ValueError(f"{weights_path} holds no draft vocabulary")
    vocab = tensors["vocab"].long()
    if vocab.numel() == 0 or int(vocab.min()) < 0 or int(vocab.max()) >= files.config.vocab_size:
        raise ValueError(f"{weights_path}: draft vocabulary ids must lie in [0, {files.config.vocab_size})")
    cfg = drafter_config(files.config, int(meta.get("intermediate_size") or files.config.intermediate_size))
    taps = meta.get("taps", [])
    try:
        check_taps(taps if isinstance(taps, list) else [taps], files.config.num_layers)
    except ValueError as e:
        raise ValueError(f"{folder / METADATA}: {e}") from None
    drafter = Drafter(cfg, vocab, dtype, taps)
    try:
        drafter.load_state_dict({k: v.long() if k == "vocab" else v for k, v in tensors.items()}, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{weights_path} does not fit a drafter for this model: {e}") from e
    return drafter.eval()


def _packed(drafter: Drafter, meta: dict[str, Any]) -> Drafter:
    quant = "int8" if meta.get("weights_dtype") == "int8" and drafter.dtype != torch.float32 else "none"
    return drafter.packed(quant)


def find_shipped(fingerprint: str, root: Path | None = None) -> Path | None:
    """The shipped drafter folder trained for the model with this fingerprint; None when none was trained
    for it (that model drafts from its context only). The package ships its drafters whole, so a
    drafters folder that is missing or empty, or a drafter missing one of its files, is a broken
    installation: a FileNotFoundError naming what is missing, never a silent run without the drafter."""
    root = root or shipped_drafters_root()
    reinstall = "this installation of splitllm lacks part of what it ships (reinstall it)"
    folders = (
        [p for p in sorted(root.iterdir()) if (p / METADATA).is_file() or (p / WEIGHTS).is_file()]
        if root.is_dir()
        else []
    )
    if not folders:
        raise FileNotFoundError(f"{root} holds no drafter: {reinstall}")
    for folder in folders:
        for name in (METADATA, WEIGHTS):
            if not (folder / name).is_file():
                raise FileNotFoundError(f"{folder / name} is missing: {reinstall}")
        if read_metadata(folder)[FINGERPRINT_KEY] == fingerprint:
            return folder
    return None


def load_drafter(
    files: ModelFiles, path: str | Path | None = None, dtype: torch.dtype = torch.float32, packed: bool = True
) -> Drafter | None:
    """`path` (a folder written by `splitllm drafter train`) if given: refused with a clear ValueError when its
    target fingerprint differs from files.fingerprint. Otherwise the drafter shipped in the package for this
    model (matched by fingerprint), or None when none was trained for it (`find_shipped`). `packed`: for
    drafting (see `Drafter.packed`); else the plain modules, to train on."""
    folder = find_shipped(files.fingerprint) if path is None else Path(path)
    if folder is None:
        return None
    meta = read_metadata(folder)
    if meta[FINGERPRINT_KEY] != files.fingerprint:
        raise ValueError(
            f"the drafter in {folder} was trained for another model "
            f"({meta.get('model', 'unknown')}, fingerprint {meta[FINGERPRINT_KEY][:12]}...), not for "
            f"{files.path} (fingerprint {files.fingerprint[:12]}...): train one with "
            f"`splitllm drafter train --model <model> --out <folder>`"
        )
    drafter = _build(files, folder, meta, dtype)
    return _packed(drafter, meta) if packed else drafter
