"""The built wheel: it holds every file the runtime reads (an editable checkout reads them from src/, so
only a wheel shows one left out of the package data), and installed with no checkout on its path, `auto`
drafts with the drafter it ships. A broken installation of the drafters is an error naming what is missing."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from splitllm.drafting import store

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "splitllm"
NOT_SHIPPED = {"__pycache__", "compiled"}  # bytecode, and the kernels `make` compiles into the package


def _runtime_files() -> list[str]:
    """Every file of the package that is not Python code, as a wheel names it: what the runtime reads."""
    return sorted(
        p.relative_to(PACKAGE.parent).as_posix()
        for p in PACKAGE.rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and not NOT_SHIPPED & set(p.relative_to(PACKAGE).parts)
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a copy of the checkout (a build in place could pick up a stale build/ there),
    offline and without build isolation, so no index is reached."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(PACKAGE, source / "src" / "splitllm", ignore=shutil.ignore_patterns(*NOT_SHIPPED, "*.pyc"))
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(dist),
         str(source)],
        check=True, capture_output=True, timeout=300,
    )
    (built,) = dist.glob("splitllm-*.whl")
    return built


def test_the_wheel_holds_every_file_the_runtime_reads(wheel: Path) -> None:
    """Each shipped drafter's two files, the web chat, the attestation roots, the kernel sources, the
    default auto profile: whatever the checkout holds besides code."""
    names = set(zipfile.ZipFile(wheel).namelist())
    drafters = sorted(n for n in names if n.startswith("splitllm/drafting/drafters/"))
    shipped = sorted(p.name for p in (PACKAGE / "drafting" / "drafters").iterdir() if p.is_dir())
    assert drafters == [f"splitllm/drafting/drafters/{d}/{f}" for d in shipped for f in (store.METADATA, store.WEIGHTS)]
    assert len(drafters) == 4  # the default model's drafter and qwen2.5-coder-1.5b's
    expected = _runtime_files()
    assert {"splitllm/api/web/index.html", "splitllm/attestation/amd/genoa/ark.pem",
            "splitllm/kernels/csrc/simd/avx2.h",
            "splitllm/decoding/sizing/auto_profile.json"} <= set(expected)
    assert [n for n in expected if n not in names] == []


def test_a_broken_installation_of_the_drafters_is_an_error_naming_what_is_missing(tmp_path: Path) -> None:
    """A model with no drafter trained for it drafts from its context (None); a missing drafters folder or
    a drafter missing a file is a broken installation, not a model without a drafter."""
    with pytest.raises(FileNotFoundError, match="holds no drafter"):
        store.find_shipped("0" * 64, tmp_path / "drafters")
    shipped = PACKAGE / "drafting" / "drafters" / "smollm2-135m-instruct"
    whole, half = tmp_path / "whole", tmp_path / "half"
    shutil.copytree(shipped, whole)
    assert store.find_shipped("0" * 64, tmp_path) is None
    fingerprint = store.read_metadata(whole)[store.FINGERPRINT_KEY]
    assert store.find_shipped(fingerprint, tmp_path) == whole
    half.mkdir()
    shutil.copy2(shipped / store.METADATA, half)
    with pytest.raises(FileNotFoundError, match=re.escape(f"{half / store.WEIGHTS} is missing")):
        store.find_shipped(fingerprint, tmp_path)
    (half / store.METADATA).rename(half / store.WEIGHTS)
    with pytest.raises(FileNotFoundError, match=re.escape(f"{half / store.METADATA} is missing")):
        store.find_shipped(fingerprint, tmp_path)


def _installed(wheel: Path, venv: Path) -> Path:
    """A fresh virtual environment holding the wheel, its dependencies taken from this interpreter's
    site-packages by a .pth path entry (no index, no reinstall of PyTorch). Such an entry adds the folder
    without reading its .pth files, so an editable install of splitllm there stays out of its path."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)],
        check=True, capture_output=True, timeout=300,
    )
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    here = sysconfig.get_paths()
    (Path(purelib) / "dependencies.pth").write_text("".join(f"{d}\n" for d in dict.fromkeys((here["purelib"],
                                                                                             here["platlib"]))))
    return python


@pytest.mark.slow
def test_an_installed_wheel_drafts_with_its_shipped_drafter(wheel: Path, tmp_path: Path) -> None:
    """`splitllm generate --decode auto` on the default model, from the wheel alone: the learned drafter
    drafts (its time, `draft_ms`, is 0 without it). Speculation needs splitllm's kernels, which a wheel
    compiles at first use (a checkout's `make` compiles them ahead); no draft model, so the drafting is the
    learned drafter's."""
    python = _installed(wheel, tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "extensions")
    check = (
        "import splitllm; print(splitllm.__file__)\n"
        "from splitllm.attestation import gpu, policy, tdx\n"
        "[policy.pinned_anchor(p) for p in policy.PRODUCTS]; gpu.nvidia_root(); tdx.intel_root()\n"
        "from splitllm.decoding.sizing.auto_profile import AutoProfile; AutoProfile.load()\n"
        "from importlib import resources; resources.files('splitllm.api').joinpath('web/index.html').read_text()\n"
    )
    loaded = subprocess.run([str(python), "-c", check], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    assert Path(loaded.stdout.strip()).is_relative_to(tmp_path / "venv")
    run = subprocess.run(
        [str(tmp_path / "venv" / "bin" / "splitllm"), "generate", "The capital of France is", "--max-new-tokens", "8",
         "--decode", "auto", "--draft-model", "none", "--json"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["new_tokens"] == 8
    assert summary["prefill"]["draft_ms"] + summary["mean_step"].get("draft_ms", 0.0) > 0, summary
