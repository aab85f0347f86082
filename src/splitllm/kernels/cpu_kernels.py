"""splitllm's CPU kernels (`csrc/`): one source per kernel over a SIMD layer, built once per instruction set.

PyTorch's bfloat16 linear kernels read a one-row step's weights at about half the memory bandwidth, and
its attention spends most of a few-row step in overhead; these stream the weights and the cache at the
bandwidth, and run a stage's whole step without a framework call between its operations (see
docs/precision.md). They give a row the same bits whatever else is in its batch, so speculation stays
exact against sequential decoding, and the same bits on every backend (`csrc/simd.h`).

Each `Variant` is the same sources compiled for one instruction set; a process loads the widest one its
CPU runs, or the one `SPLITLLM_KERNELS` names (`avx512`, `avx2`, `neon`; `off` runs PyTorch's kernels),
so a wider CPU can run the narrower paths. `build()` compiles every variant this CPU runs into the package
(`python -m splitllm.kernels`, which `make` runs at install), so a first answer waits for no compiler;
a variant not built there is compiled on first use into PyTorch's extension cache (`TORCH_EXTENSIONS_DIR`).
Where none runs, `load()` says why in one log line and returns None, and callers use PyTorch's kernels.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from splitllm.progress import working

log = logging.getLogger(__name__)
CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name for name in ("bindings.cpp", "linear.cpp", "attention.cpp", "decoder.cpp")]
COMPILED = Path(__file__).with_name("compiled")  # where build() puts the variants (not in git)
SWITCH = "SPLITLLM_KERNELS"
# Every variant: a definition that matches no declaration in kernels.h fails the build (it would load as a
# missing symbol); nothing is fused that the SIMD layer does not fuse, so every backend rounds alike.
COMMON_FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-Werror=missing-declarations")


@dataclass(frozen=True)
class Variant:
    """The kernels compiled for one instruction set: `features` are the CPU flags it needs (as Linux's
    /proc/cpuinfo names them), `path` what benchmark records call its linear kernel, and `shared_rows` how
    many rows one pass over bfloat16, int8 and int4 weights takes for about the cost of one (rows share each
    weight load while the memory's bandwidth bounds the pass; AVX2's and NEON's multiply-adds do a quarter
    of VDPBF16PS's work per instruction, so their extra rows cost more: there a bfloat16 pass still reads
    about as long as four rows' products take, an int8 pass two rows', while int4 weights, read at half
    the bytes, leave each row's products to pay)."""

    name: str
    machines: tuple[str, ...]
    features: frozenset[str]
    flags: tuple[str, ...]
    path: str
    shared_rows: tuple[int, int, int]

    @functools.cached_property
    def module(self) -> str:
        """The extension's name: the variant and a digest of its sources, flags and PyTorch's version, so a
        build from other sources is never loaded (read once per process)."""
        import torch

        digest = hashlib.sha256(f"{self.flags}{COMMON_FLAGS}{torch.__version__}".encode())
        for source in sorted([*SOURCES, *CSRC.rglob("*.h")]):
            digest.update(source.relative_to(CSRC).as_posix().encode() + source.read_bytes())
        return f"splitllm_kernels_{self.name}_{digest.hexdigest()[:12]}"


_X86 = ("x86_64", "AMD64")
VARIANTS = (  # widest first: a process takes the first its CPU runs
    Variant("avx512", _X86, frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512vbmi", "avx512_vnni"}),
            ("-DSPLITLLM_SIMD_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vbmi",
             "-mavx512vnni", "-mamx-tile", "-mamx-bf16"), "avx512-dot-products", (4, 2, 2)),
    Variant("avx2", _X86, frozenset({"avx2", "fma", "f16c"}), ("-DSPLITLLM_SIMD_AVX2", "-mavx2", "-mfma", "-mf16c"),
            "avx2-fma", (4, 2, 1)),
    # NEON unpacks nibbles and multiplies as AVX2 does (not measured on ARM here): taken as AVX2's.
    Variant("neon", ("aarch64", "arm64"), frozenset({"asimd"}), ("-DSPLITLLM_SIMD_NEON",), "neon-fma", (4, 2, 1)),
)


@functools.cache
def cpu_features() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (x86 `flags`, ARM `Features`); empty elsewhere (read once)."""
    if platform.system() != "Linux":
        return frozenset()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    line = next((line for line in lines if line.startswith(("flags", "Features"))), "")
    return frozenset(line.partition(":")[2].split())


def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (AVX-512 BF16, AMX, ARM's BF16): elsewhere
    PyTorch's bfloat16 products are emulated, several times slower than float32's."""
    return bool(cpu_features() & {"avx512_bf16", "amx_bf16", "bf16"})


def runnable() -> list[Variant]:
    """The variants this CPU runs, widest first."""
    features, machine = cpu_features(), platform.machine()
    return [v for v in VARIANTS if machine in v.machines and v.features <= features]


def widest() -> Variant | None:
    """The widest variant this CPU runs (None: none), whatever `SPLITLLM_KERNELS` picks: the CPU's kind."""
    return next(iter(runnable()), None)


def _switch() -> str:
    """`SPLITLLM_KERNELS` as given, `auto` when unset or empty."""
    return os.environ.get(SWITCH, "").strip().lower() or "auto"


def chosen() -> Variant | None:
    """The variant this process uses: `SPLITLLM_KERNELS`'s, else the widest this CPU runs (None: PyTorch's
    kernels). Naming one the CPU cannot run is an error, not a silent fallback."""
    wanted = _switch()
    names = [v.name for v in VARIANTS]
    if wanted not in (*names, "auto", "off"):
        raise ValueError(f"{SWITCH} must be auto, off or one of {', '.join(names)}; got {wanted!r}")
    if wanted == "off":
        return None
    if wanted == "auto":
        return widest()
    variant = next(v for v in VARIANTS if v.name == wanted)
    if variant not in runnable():
        raise ValueError(f"{SWITCH}={wanted}: this CPU lacks {', '.join(sorted(variant.features - cpu_features()))}")
    return variant


@functools.cache
def load() -> ModuleType | None:
    """The compiled kernels, or None where they cannot run here (cached, so the reason is logged once per process)."""
    variant = chosen()
    if variant is None:
        no_variant = "no kernel variant for this CPU (x86-64 needs AVX2 and FMA; ARM64 NEON)"
        reason = f"{SWITCH}=off" if _switch() == "off" else no_variant
    else:
        built = prebuilt(variant)
        if built is not None:
            return built
        from torch.utils import cpp_extension

        compiler = cpp_extension.get_cxx_compiler()
        if shutil.which(compiler) is None:
            reason = f"no C++ compiler ({compiler})"
        else:
            try:
                with working(f"building splitllm's {variant.name} CPU kernels (once per machine)"):
                    return compile_variant(variant)
            except Exception as err:  # no ninja, a compiler without these instructions, a compile error
                reason = f"the build failed: {_gist(err)}"
    log.warning("CPU kernels unavailable, using PyTorch's: %s", reason)
    return None


def compile_variant(variant: Variant, directory: Path | None = None) -> ModuleType:
    """Compile `variant` with the system's compiler and ninja (into `directory`, else PyTorch's cache) and load it."""
    from torch.utils import cpp_extension

    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        variant.module, [str(p) for p in SOURCES], extra_cflags=[*COMMON_FLAGS, *variant.flags],
        extra_ldflags=["-fopenmp"], build_directory=None if directory is None else str(directory), verbose=False,
    )


def prebuilt(variant: Variant) -> ModuleType | None:
    """`variant` as build() left it in the package, imported without a compiler (None: not built there)."""
    name, library = variant.module, prebuilt_path(variant)
    if not library.is_file():
        return None
    import torch  # noqa: F401  (the extension links against PyTorch's libraries, loaded first)

    spec = importlib.util.spec_from_file_location(name, library)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build() -> list[str]:
    """Compile every variant this CPU runs into the package (the narrower ones too, so `SPLITLLM_KERNELS`
    can pick them); returns their names. Stale builds of other sources are removed."""
    built = []
    for variant in runnable():
        directory = COMPILED / variant.name
        if prebuilt_path(variant).is_file():
            built.append(variant.name)
            continue
        shutil.rmtree(directory, ignore_errors=True)
        compile_variant(variant, directory)
        built.append(variant.name)
    return built


def prebuilt_path(variant: Variant) -> Path:
    """Where build() leaves `variant`'s library."""
    return COMPILED / variant.name / f"{variant.module}.so"


def _gist(err: Exception) -> str:
    """The line of a failed build that says what went wrong: the first compiler error, else the message's last line."""
    lines = str(err).strip().splitlines() or [type(err).__name__]
    return next((line.strip() for line in lines if "error:" in line), lines[-1])


def linear_path() -> str:
    """Which instructions run the 16-bit and quantized linear layers here, for benchmark records."""
    kernels, variant = load(), chosen()
    if kernels is None or variant is None:
        return "pytorch"
    return "amx-tiles" if kernels.tiles_available() else variant.path
