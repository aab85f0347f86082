"""`splitllm bench speed`'s loads and memory, each in a fresh process so neither caches nor earlier
allocations flatter them: load time (cold, GGUF conversion into an empty cache, and cached) and the
peak RSS of a process holding the server's layers against the whole model's.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from splitllm.client.client_model import ClientModel
from splitllm.lab.bench.speed_compute import MIB, weight_bytes_of
from splitllm.model.precision import Precision
from splitllm.model.stage import Stage
from splitllm.weights.sources import ModelFiles
from splitllm.server.app import MiddleServer
from splitllm.server.settings import ServerSettings
from splitllm.threads import set_compute_threads


def _rss_mib() -> dict[str, float]:
    """This process's resident memory: now (VmRSS), at its peak (VmHWM), and ru_maxrss.

    ru_maxrss survives fork and exec, so a child started by a bigger process reports at least the
    parent's size; VmHWM belongs to the address space exec created, hence the figure compared.
    """
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {
        "now": int(status["VmRSS"].split()[0]) / 1024,
        "peak": int(status["VmHWM"].split()[0]) / 1024,
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
    }


def child(kind: str, first: int | str, last: int | str, setting: str = "float32-none") -> dict[str, float]:
    """One measurement in this (fresh) process: 'load', 'server_rss' or 'full_rss'."""
    set_compute_threads(1)
    first, last = int(first), int(last)
    precision = Precision.from_name(setting)
    settings = ServerSettings(first=first, last=last, dtype=precision.dtype, quant=precision.quant)
    baseline = _rss_mib()["now"]
    t0 = time.perf_counter()
    if kind == "load":
        files = ModelFiles(None)  # converts the GGUF when the cache is empty
        t1 = time.perf_counter()
        server = MiddleServer(None, settings)  # fingerprint + middle layers
        t2 = time.perf_counter()
        ClientModel(files, first, last, precision)
        t3 = time.perf_counter()
        assert server.fingerprint == files.fingerprint
        return {"resolve_s": t1 - t0, "server_s": t2 - t1, "client_s": t3 - t2, "total_s": t3 - t0}
    if kind == "server_rss":
        server = MiddleServer(None, settings)
        weights = weight_bytes_of(server.stage)
    elif kind == "full_rss":
        files = ModelFiles(None)
        stage = Stage.load(files, 0, files.config.num_layers, torch.float32)
        rest = files.read(["model.embed_tokens.weight", "model.norm.weight"], torch.float32)
        for t in rest.values():
            t.sum()  # a read tensor may be a file mapping nothing touched yet; in use it is resident
        weights = weight_bytes_of(stage) + sum(t.nbytes for t in rest.values())
    else:
        raise ValueError(f"unknown measurement {kind!r}")
    peak = _rss_mib()
    return {
        "baseline_mib": baseline,
        "peak_mib": peak["peak"],
        "ru_maxrss_mib": peak["ru_maxrss"],
        "weights_mib": weights / MIB,
        "load_s": time.perf_counter() - t0,
    }


def _in_subprocess(
    kind: str, first: int, last: int, setting: str = "float32-none", env: dict[str, str] | None = None
) -> dict[str, float]:
    code = (
        "import json, sys; from splitllm.lab.bench.speed_loading import child; print(json.dumps(child(*sys.argv[1:])))"
    )
    command = [sys.executable, "-c", code, kind, str(first), str(last), setting]
    proc = subprocess.run(command, env={**os.environ, **(env or {})}, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"measurement {kind} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def load_times(first: int, last: int, settings: Sequence[str]) -> dict[str, dict[str, float]]:
    """Cold: GGUF conversion into an empty cache (exact mode); then each setting's first (converting) and
    cached load."""
    with tempfile.TemporaryDirectory(prefix="splitllm-cold-") as empty:
        out = {"cold": _in_subprocess("load", first, last, env={"SPLITLLM_CACHE": empty})}
        for setting in settings:
            if setting != "float32-none":
                out[f"first {setting}"] = _in_subprocess("load", first, last, setting, {"SPLITLLM_CACHE": empty})
    for setting in settings:
        out[f"cached {setting}"] = _in_subprocess("load", first, last, setting)
    return out


def peak_rss(first: int, last: int, settings: Sequence[str]) -> dict[str, dict[str, float]]:
    out = {f"server {s}": _in_subprocess("server_rss", first, last, s) for s in settings}
    return {**out, "full_model float32-none": _in_subprocess("full_rss", first, last)}
