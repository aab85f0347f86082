"""splitllm's CPU kernels (`csrc/`), compiled on first use where the CPU has AVX-512 BF16 and VBMI.

PyTorch's bfloat16 linear kernels read a one-row step's weights at about half this machine's memory
bandwidth, and its attention spends most of a few-row step in overhead; these stream the weights and
the cache at the bandwidth, and run a stage's whole step without a framework call between its
operations (see docs/precision.md). Both give a row the same bits whatever else is in
its batch, so speculation stays exact against sequential decoding. They are built with the system's
C++ compiler through `torch.utils.cpp_extension` into PyTorch's extension cache (a one-time wait, see
docs/precision.md; once per machine and source version; `TORCH_EXTENSIONS_DIR` moves it); where the
CPU lacks the instructions, there is no compiler or the build fails, `load()` says why in one log line
and returns None, and callers use PyTorch's kernels.
"""

from __future__ import annotations

import functools
import logging
import platform
import shutil
from pathlib import Path
from types import ModuleType

from splitllm.progress import working

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).with_name("csrc") / name for name in ("bindings.cpp", "linear.cpp", "attention.cpp", "decoder.cpp")]
# A definition that matches no declaration in kernels.h fails the build (it would load as a missing symbol).
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vbmi", "-mamx-tile", "-mamx-bf16", "-fopenmp", "-Werror=missing-declarations"]


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
    """The compiled kernels, or None where they cannot run here (cached, so the reason is logged once per process)."""
    from torch.utils import cpp_extension

    compiler = cpp_extension.get_cxx_compiler()
    if not cpu_has_instructions():
        reason = "the CPU lacks AVX-512 BF16 or VBMI"
    elif shutil.which(compiler) is None:
        reason = f"no C++ compiler ({compiler})"
    else:
        try:
            with working("building splitllm's CPU kernels (once per machine)"):
                return cpp_extension.load(
                    "splitllm_cpu_kernels", [str(p) for p in SOURCES], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                    verbose=False,
                )
        except Exception as err:  # no ninja, a compiler without these instructions, a compile error
            reason = f"the build failed: {_gist(err)}"
    log.warning("CPU kernels unavailable, using PyTorch's: %s", reason)
    return None


def _gist(err: Exception) -> str:
    """The line of a failed build that says what went wrong: the first compiler error, else the message's last line."""
    lines = str(err).strip().splitlines() or [type(err).__name__]
    return next((line.strip() for line in lines if "error:" in line), lines[-1])


def linear_path() -> str:
    """Which instructions run the 16-bit and quantized linear layers here, for benchmark records."""
    kernels = load()
    if kernels is None:
        return "pytorch"
    return "amx-tiles" if kernels.tiles_available() else "avx512-dot-products"
