"""Benchmark results published under docs/results/, and the doc tables generated from them.

A published result is JSON with its provenance (date, commit, CPU, command); a doc shows it only in a
block between `<!-- results:NAME -->` and `<!-- /results:NAME -->`, regenerated from that JSON, so a
figure in the docs always traces back to a run (a test fails when the two drift apart). A result
measured on a CPU without AVX-512 is published beside the AVX-512 one, named for its CPU kind
(`published_name`), so neither kind's figures overwrite the other's.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
from importlib import metadata
from pathlib import Path

from splitllm.lab import CHECKOUT

RESULTS = CHECKOUT / "docs" / "results"


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=CHECKOUT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(command: str) -> dict:
    """What a figure is tied to: when, which code, on what machine, by which command."""
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": _git("status", "--porcelain", "--untracked-files=no", "src") not in ("", "unknown"),
        "cpu": cpu_name(),
        "cores": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "torch": metadata.version("torch"),
        "command": command,
    }


def published_name(name: str) -> str:
    """Where a result measured here is published: NAME on a CPU that runs the AVX-512 kernels, NAME-KIND
    on a narrower one (`kernels-avx2`), so each CPU kind's figures sit beside the others'."""
    from splitllm.kernels import cpu_kernels

    widest = cpu_kernels.widest()
    kind = "generic" if widest is None else widest.name
    return name if kind == "avx512" else f"{name}-{kind}"


def _block(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- results:{name} -->\n)(.*?)(<!-- /results:{name} -->)", re.S)


def rendered(text: str, name: str, body: str) -> str:
    """`text` with the block NAME replaced by `body`; ValueError if the text has no such block."""
    pattern = _block(name)
    if not pattern.search(text):
        raise ValueError(f"no <!-- results:{name} --> block")
    return pattern.sub(lambda m: m.group(1) + body.rstrip("\n") + "\n" + m.group(3), text)


def block(text: str, name: str) -> str:
    """The current content of block NAME."""
    match = _block(name).search(text)
    if match is None:
        raise ValueError(f"no <!-- results:{name} --> block")
    return match.group(2)


def update_doc(doc: Path, name: str, body: str) -> bool:
    """Regenerate block NAME of `doc`; whether the file changed."""
    text = doc.read_text()
    new = rendered(text, name, body)
    if new != text:
        doc.write_text(new)
    return new != text
