"""The model fingerprint comes from the source files and the decoder math, not from library state; the
loaded-weights fingerprint from the bytes a load built its tensors from."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from splitllm.model.precision import Precision
from splitllm.model.stage import Stage
from splitllm.weights.conversions import StoredWeights
from splitllm.weights.loaded import read_safetensors
from splitllm.weights.sources import ModelFiles, _file_digest, packaged_gguf_path


def _copy(folder: Path, dest: Path) -> Path:
    shutil.copytree(folder, dest)
    return dest


def test_fingerprint_ignores_library_version_fields(tiny_models, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPLITLLM_CACHE", str(tmp_path / "cache"))
    before = ModelFiles(tiny_models["llama"]).fingerprint
    copy = _copy(tiny_models["llama"], tmp_path / "llama")
    config = json.loads((copy / "config.json").read_text())
    config["transformers_version"] = "0.0.1"
    config["some_new_default"] = True  # a field a later release adds to every saved config
    (copy / "config.json").write_text(json.dumps(config))
    assert ModelFiles(copy).fingerprint == before


def test_fingerprint_tracks_weights_and_math(tiny_models, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPLITLLM_CACHE", str(tmp_path / "cache"))
    before = ModelFiles(tiny_models["llama"]).fingerprint
    assert ModelFiles(tiny_models["qwen2"]).fingerprint != before
    copy = _copy(tiny_models["llama"], tmp_path / "llama")
    config = json.loads((copy / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (copy / "config.json").write_text(json.dumps(config))
    assert ModelFiles(copy).fingerprint != before
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    config["rms_norm_eps"] = 1e-5
    (copy / "config.json").write_text(json.dumps(config))
    assert ModelFiles(copy).fingerprint != before


@pytest.mark.slow
def test_default_fingerprint_survives_a_rebuilt_conversion_cache(default_files, tmp_path, monkeypatch) -> None:
    """The real default model: a rewritten conversion cache (another dtype, another transformers
    release's config) keeps the fingerprint, which hashes the .gguf itself."""
    before = default_files.fingerprint
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPLITLLM_CACHE", str(cache))
    dest = cache / "models" / default_files.path.name
    dest.mkdir(parents=True)
    for f in default_files.path.iterdir():
        (dest / f.name).symlink_to(f)
    (dest / "config.json").unlink()
    config = json.loads((default_files.path / "config.json").read_text())
    config["transformers_version"] = "9.9.9"
    config["dtype"] = "bfloat16"
    (dest / "config.json").write_text(json.dumps(config))
    rebuilt = ModelFiles(None)
    assert rebuilt.path == dest
    gguf = packaged_gguf_path("default")
    assert rebuilt.sources == [(gguf.name, _file_digest(gguf))]
    assert rebuilt.fingerprint == before
    assert ModelFiles(dest).fingerprint == before  # named by its converted folder: the same model


@pytest.mark.slow
def test_default_fingerprint_by_any_name(default_files) -> None:
    assert ModelFiles("default").fingerprint == ModelFiles(default_files.path).fingerprint == default_files.fingerprint


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_fingerprint_is_stable_across_instances(tiny_models, name) -> None:
    assert ModelFiles(tiny_models[name]).fingerprint == ModelFiles(tiny_models[name]).fingerprint


@pytest.mark.parametrize("setting", ["float32-none", "bfloat16-int8"])
def test_the_loaded_fingerprint_is_the_digest_of_the_loaded_files_bytes(  # type: ignore[no-untyped-def]
    setting, tiny_models, tmp_path, monkeypatch
) -> None:
    """The definition in weights/loaded.py, computed here from the files' bytes alone: the checkpoint
    itself in the exact mode, the precision's converted layer files otherwise."""
    monkeypatch.setenv("SPLITLLM_CACHE", str(tmp_path / "cache"))
    files, precision = ModelFiles(tiny_models["llama"]), Precision.from_name(setting)
    stage = Stage.load(files, 1, 3, precision)
    if precision.exact:
        loaded = [files.path / "model.safetensors"]
    else:
        folder = StoredWeights(files, precision, ()).folder
        loaded = [folder / "layer-0001.safetensors", folder / "layer-0002.safetensors"]
    document = {
        "format": "splitllm-loaded-weights-1",
        "config": dataclasses.asdict(files.config),
        "layers": [1, 3],
        "precision": setting,
        "files": [[f.name, hashlib.sha256(f.read_bytes()).hexdigest()] for f in loaded],
    }
    expected = hashlib.sha256(json.dumps(document, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert stage.loaded_fingerprint == expected
    assert Stage.load(files, 1, 2, precision).loaded_fingerprint != expected  # another split, another value


@pytest.mark.parametrize("setting", ["bfloat16-int8", "bfloat16-int4"])
def test_a_conversion_writes_the_same_bytes_every_time(setting, tiny_models, tmp_path,  # type: ignore[no-untyped-def]
                                                       monkeypatch) -> None:
    """A policy writer's `splitllm attest weights` converts on its own machine and must get the server's
    value, so a converted file's bytes depend on its tensors alone: its header is written in one order
    (safetensors writes metadata in a hash map's order, which varies between writes)."""
    files, precision = ModelFiles(tiny_models["llama"]), Precision.from_name(setting)
    seen = set()
    for i in range(6):
        monkeypatch.setenv("SPLITLLM_CACHE", str(tmp_path / f"cache-{i}"))
        folder = StoredWeights(files, precision, ()).folder
        seen.add((Stage.load(files, 1, 3, precision).loaded_fingerprint,
                  tuple(hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.glob("*.safetensors")))))
        header = (folder / "layer-0001.safetensors").read_bytes()
        size = int.from_bytes(header[:8], "little")
        keys = list(json.loads(header[8 : 8 + size]))
        assert keys == sorted(keys) and list(json.loads(header[8 : 8 + size])["__metadata__"]) == ["format",
                                                                                                   "precision"]
    assert len(seen) == 1


def test_read_safetensors_hashes_every_byte_and_keeps_what_it_is_asked(  # type: ignore[no-untyped-def]
    tiny_models
) -> None:
    path = tiny_models["qwen2"] / "model.safetensors"
    tensors, digest = read_safetensors(path, lambda name: name.startswith("model.layers.1."))
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    with safe_open(path, framework="pt") as st:
        kept = [k for k in st.keys() if k.startswith("model.layers.1.")]
        assert sorted(tensors) == sorted(kept) and "model.layers.1.self_attn.q_proj.bias" in tensors
        for name in kept:
            assert torch.equal(tensors[name], st.get_tensor(name)), name
    assert read_safetensors(path, lambda name: False) == ({}, digest)


def test_a_truncated_weight_file_is_refused(tiny_models, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "model.safetensors"
    path.write_bytes((tiny_models["llama"] / "model.safetensors").read_bytes()[:-1])
    with pytest.raises(ValueError, match="ends before"):
        read_safetensors(path, lambda name: True)
