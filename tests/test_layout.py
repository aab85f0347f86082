"""How the package hangs together: the import contracts declared in pyproject.toml hold on the real
import graph (the command line over the lab over the runtime; the runtime's layers importing only
downwards; the lab's parts independent), and the runtime imports no plotting or research dependency."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ["splitllm.cli", "splitllm.server.app", "splitllm.client.client", "splitllm.api.openai"]


def _lint(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command as c; c()",
         "--config", str(config), "--no-cache"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )


def test_the_declared_import_contracts_hold() -> None:
    run = _lint(ROOT / "pyproject.toml")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 kept, 0 broken" in run.stdout


def test_a_layer_order_the_real_imports_disagree_with_is_refused(tmp_path: Path) -> None:
    """The same layers with the lab moved under the client and server: its real imports of them break it."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = config["contracts"][0]["layers"]
    assert layers[:2] == ["splitllm.cli", "splitllm.lab"]
    swapped = [layers[0], *layers[2:5], layers[1], *layers[5:]]
    ini = [
        "[importlinter]\nroot_package = splitllm\n\n[importlinter:contract:swapped]\n"
        "name = swapped\ntype = layers\nlayers ="
    ]
    ini += [f"    {layer}" for layer in swapped]
    path = tmp_path / "swapped.ini"
    path.write_text("\n".join(ini) + "\n")
    run = _lint(path)
    assert run.returncode != 0 and "splitllm.lab" in run.stdout and "BROKEN" in run.stdout


@pytest.mark.parametrize("module", RUNTIME)
def test_the_runtime_imports_no_plotting_or_research_dependency(module: str) -> None:
    code = f"import sys; import {module}; print(sorted({{'matplotlib', 'scipy', 'ray'}} & set(sys.modules)))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
