"""How the package hangs together: decoders depend on no client code, and the runtime (plotting
modules included, until they plot) imports no plotting or research dependency."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import splitllm.decoding

RUNTIME = [
    "splitllm.cli", "splitllm.server.app", "splitllm.client.session", "splitllm.api.openai", "splitllm.demo",
    "splitllm.bench.sweep_report", "splitllm.bench.load", "splitllm.privacy.report",
]


def test_decoders_import_nothing_from_the_client() -> None:
    for path in Path(splitllm.decoding.__file__).parent.rglob("*.py"):
        tree = ast.parse(path.read_text())
        imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in imported if m.startswith("splitllm.client")], path


def test_the_runtime_imports_no_plotting_or_research_dependency() -> None:
    code = f"import sys; import {', '.join(RUNTIME)}; print(sorted({{'matplotlib', 'scipy', 'ray'}} & set(sys.modules)))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
