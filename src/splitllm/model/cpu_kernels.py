"""splitllm's CPU kernels (`kernels/`), compiled on first use where the CPU has AVX-512 BF16 and VBMI.

PyTorch's bfloat16 linear kernels read a one-row step's weights at about half this machine's memory
bandwidth, and its attention spends most of a few-row step in overhead; these stream the weights and
the cache at the bandwidth, and run a stage's whole step without a framework call between its
operations (see docs/precision.md). Both give a row the same bits whatever else is in
its batch, so speculation stays exact against sequential decoding. They are built with the system's
C++ compiler through `torch.utils.cpp_extension` into PyTorch's extension cache (about 30 s, once per
machine and source version; `TORCH_EXTENSIONS_DIR` moves it); where the CPU lacks the instructions
or the build fails, `load()` returns None and callers use PyTorch's kernels.
"""

from __future__ import annotations

import functools
import logging
import platform
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).with_name("kernels") / name for name in ("bindings.cpp", "linear.cpp", "attention.cpp", "decoder.cpp")]
# A definition that matches no declaration in kernels.h fails the build (it would load as a missing symbol).
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vbmi", "-fopenmp", "-Werror=missing-declarations"]


def cpu_has_instructions() -> bool:
    """AVX-512 with BF16 dot products and VBMI byte permutes (AMD Zen 4, Intel Sapphire Rapids and later)."""
    if platform.system() != "Linux":
        return False
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512vbmi"} <= set(flags.split())


@functools.cache
def load() -> ModuleType | None:
    """The compiled kernels, or None where it cannot run here (said once in the log)."""
    if not cpu_has_instructions():
        return None
    from torch.utils import cpp_extension

    try:
        return cpp_extension.load(
            "splitllm_cpu_kernels", [str(p) for p in SOURCES], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], verbose=False,
        )
    except Exception as err:  # no compiler, no ninja, a compiler without these instructions
        log.warning("CPU kernels unavailable, using PyTorch's: %s", (str(err).strip().splitlines() or [""])[-1])
        return None
