"""The model fingerprint comes from the source files and the decoder math, not from library state."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

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
