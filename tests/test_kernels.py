"""splitllm's CPU kernels (linear in bfloat16, int8 and int4, attention over a float32 cache, a kernel stage
running a stage's layers in one call): close to the reference, and batch-invariant, the property speculation's
exactness rests on: a row gets the same bits alone, among other rows, inside a tree whose other nodes are
masked, or after its ancestors were committed."""

from __future__ import annotations

import logging
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from splitllm.kernels import cpu_kernels
from splitllm.model.attention import KernelAttention, torch_attention
from splitllm.model.kv import KVCache
from splitllm.model.precision import Precision
from splitllm.model.quant import BlockedLinear, Int4Linear, Int8Linear, on_huge_pages
from splitllm.model.stage import Stage, Step
from splitllm.weights.sources import ModelFiles
from splitllm.model.visibility import Visibility

KERNELS = cpu_kernels.load()


def test_kernels_build_wherever_the_cpu_runs_them() -> None:
    """A missing compiler must fail here, not fall back silently to the slower kernels; SPLITLLM_KERNELS
    picks a narrower variant, and the default is the widest this CPU runs."""
    variant = cpu_kernels.chosen()
    switch = os.environ.get(cpu_kernels.SWITCH, "auto")
    assert (KERNELS is not None) == (variant is not None)
    if switch == "auto":
        assert variant == next(iter(cpu_kernels.runnable()), None)
    elif switch != "off":
        assert variant is not None and variant.name == switch


def test_a_variant_the_cpu_cannot_run_or_a_misspelt_one_is_refused(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(cpu_kernels, "cpu_features", lambda: frozenset({"avx2", "fma", "f16c"}))
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv(cpu_kernels.SWITCH, "avx512")
    with pytest.raises(ValueError, match="SPLITLLM_KERNELS=avx512: this CPU lacks avx512_bf16, avx512_vnni, avx512bw"):
        cpu_kernels.chosen()
    monkeypatch.setenv(cpu_kernels.SWITCH, "avx-2")
    with pytest.raises(ValueError, match="auto, off or one of avx512, avx2, neon"):
        cpu_kernels.chosen()
    monkeypatch.setenv(cpu_kernels.SWITCH, "auto")
    assert cpu_kernels.chosen().name == "avx2"  # an AVX2-only CPU (Zen 3, Intel client chips) gets the AVX2 kernels
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(cpu_kernels, "cpu_features", lambda: frozenset({"fp", "asimd", "bf16"}))
    assert cpu_kernels.chosen().name == "neon"


@pytest.mark.parametrize(
    ("missing", "said"),
    [("instructions", "no kernel variant for this CPU (x86-64 needs AVX2 and FMA; ARM64 NEON)"),
     ("compiler", "no C++ compiler (/nowhere/c++)"),
     ("build", "the build failed: kernels/linear.cpp:9:1: error: 'x' was not declared")],
)
def test_each_fallback_says_why_in_one_line(missing, said, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """`load` is cached, so each reason is logged once per process; here it runs uncached and builds nothing."""
    from torch.utils import cpp_extension

    def fails(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"Error building extension: [1/4] c++ ...\n{said.split(': ', 1)[1]}\nninja: build stopped")

    monkeypatch.delenv(cpu_kernels.SWITCH, raising=False)
    if missing == "instructions":
        monkeypatch.setattr(cpu_kernels, "runnable", lambda: [])
    monkeypatch.setattr(cpu_kernels, "prebuilt", lambda variant: None)  # as if `make` had not built them
    compiler = "/nowhere/c++" if missing == "compiler" else sys.executable  # any executable stands in for one
    monkeypatch.setattr(cpp_extension, "get_cxx_compiler", lambda: compiler)
    monkeypatch.setattr(cpp_extension, "load", fails)
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.load.__wrapped__() is None
    assert [r.getMessage() for r in caplog.records] == [f"CPU kernels unavailable, using PyTorch's: {said}"]


def test_install_builds_every_variant_the_cpu_runs_so_no_first_use_compiles() -> None:
    """`make` runs `python -m splitllm.kernels`: each variant is in the package, loaded without a compiler."""
    for variant in cpu_kernels.runnable():
        assert cpu_kernels.prebuilt_path(variant).is_file(), f"{variant.name} was not built at install"


CHECK_FLAGS = ("-O2", "-ffp-contract=off", "-std=c++20")  # as the extension's: nothing fused the layer does not fuse


def _check_builds() -> dict[str, tuple[list[str], list[str]] | str]:
    """Per SIMD backend, the compiler command and the runner for kernel_check.cpp where this machine builds
    and runs that backend (ARM64 NEON on x86-64: cross-compiled, under qemu-user), else why not."""
    cxx = shutil.which("g++")
    assert cxx, "no g++ (make toolchain installs it)"
    features, machine = cpu_kernels.cpu_features(), platform.machine()
    builds: dict[str, tuple[list[str], list[str]] | str] = {"scalar": ([cxx], [])}
    for v in cpu_kernels.VARIANTS:
        if machine in v.machines:
            missing = v.features - features
            builds[v.name] = f"this CPU lacks {', '.join(sorted(missing))}" if missing else ([cxx, *v.flags], [])
        elif v.name == "neon":
            cross, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
            builds[v.name] = ([cross, *v.flags, "-static"], [qemu]) if cross and qemu else (
                "no aarch64-linux-gnu-g++ or qemu-aarch64 to check NEON with (`make arm-check-tools` installs them)")
        else:
            builds[v.name] = f"{v.name} does not run on {machine}"
    return builds


@pytest.fixture(scope="module")
def kernel_checks(tmp_path_factory) -> dict[str,  # type: ignore[no-untyped-def]
                                            subprocess.CompletedProcess[str] | str]:
    """kernel_check.cpp built for every backend this machine runs (the compilers side by side) and run once
    each, its outputs dumped to <backend>.bin beside it; a backend that cannot run here maps to the reason."""
    out = tmp_path_factory.mktemp("kernel_check")
    source = cpu_kernels.CSRC / "kernel_check.cpp"
    results: dict[str, subprocess.CompletedProcess[str] | str] = {}
    compiling = {}
    for name, build in _check_builds().items():
        if isinstance(build, str):
            results[name] = build
            continue
        compiler, runner = build
        command = [*compiler, *CHECK_FLAGS, "-I", str(cpu_kernels.CSRC), str(source), "-o", str(out / name)]
        compiling[name] = (subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
                           runner)
    for name, (compiler, runner) in compiling.items():
        log, _ = compiler.communicate(timeout=300)
        if compiler.returncode != 0:
            results[name] = subprocess.CompletedProcess(compiler.args, compiler.returncode, f"build failed:\n{log}")
            continue
        results[name] = subprocess.run([*runner, str(out / name), "--dump", str(out / f"{name}.bin")],
                                       capture_output=True, text=True, timeout=300)
    return results


@pytest.mark.parametrize("backend", ["scalar", "avx2", "avx512", "neon"])
def test_every_simd_backend_gives_the_scalar_references_bits(backend,  # type: ignore[no-untyped-def]
                                                             kernel_checks) -> None:
    """The kernels' claim of one set of bits on every CPU, checked without PyTorch by csrc/kernel_check.cpp:
    each backend matches float64 references and simd.h's spec of every primitive, and writes byte for byte
    the scalar reference's outputs (for NEON too, which no x86-64 machine could otherwise check)."""
    result = kernel_checks[backend]
    if isinstance(result, str):
        pytest.skip(result)
    assert result.returncode == 0 and re.fullmatch(r"kernel_check: \d+ checks passed\n", result.stdout), (
        result.stdout[-3000:] + result.stderr[-1000:])
    dumps = Path(result.args[-1]), Path(result.args[-1]).with_name("scalar.bin")
    assert dumps[1].exists(), "the scalar reference did not run"
    assert dumps[0].read_bytes() == dumps[1].read_bytes(), f"{backend}'s outputs are not the scalar reference's bits"


needs_kernels = pytest.mark.skipif(KERNELS is None,
                                   reason="no kernel variant runs on this CPU (or SPLITLLM_KERNELS=off)")
VARIANTS = {v.name: built for v in cpu_kernels.runnable() if (built := cpu_kernels.prebuilt(v)) is not None}


@pytest.mark.skipif(len(VARIANTS) < 2, reason="one kernel variant runs here")
def test_every_variant_gives_the_same_bits() -> None:
    """The SIMD layer states each kernel once: AVX-512 BF16's dot products and AVX2's fused multiply-adds
    (odd input first) round alike, so the linear in every form and the attention agree bit for bit."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(9, 96, generator=gen).bfloat16()
    w, bias = torch.randn(70, 96, generator=gen).bfloat16(), torch.randn(70, generator=gen)
    q8, scales = torch.randint(-127, 128, (70, 96), generator=gen, dtype=torch.int8), torch.rand(70, generator=gen) / 50
    q4 = torch.randint(0, 16, (70, 96), generator=gen, dtype=torch.uint8)
    sz = (torch.randn(70, 3, 2, generator=gen) / 50).half()
    q, k, v = (torch.randn(1, h, n, 64, generator=gen) for h, n in ((8, 3), (2, 37), (2, 37)))
    mask = torch.zeros(3, 37).masked_fill(torch.rand(3, 37, generator=gen) < 0.3, float("-inf"))

    def outputs(kernels: object) -> list[torch.Tensor]:
        int4, packed_sz = kernels.pack_int4(q4, sz)
        return [kernels.linear(x, kernels.pack(w), 70, bias, None),
                kernels.linear(x, kernels.pack(q8), 70, None, scales),
                kernels.linear(x, int4, 70, bias, packed_sz), kernels.attention(q, k, v, mask, 0.125)]

    first, *others = (outputs(kernels) for kernels in VARIANTS.values())
    for other in others:
        assert all(torch.equal(a, b) for a, b in zip(first, other))


@pytest.mark.slow  # a pytest run of its own
@pytest.mark.skipif("avx2" not in VARIANTS or cpu_kernels.chosen() is None or cpu_kernels.chosen().name == "avx2",
                    reason="no wider variant runs here")
def test_the_avx2_path_holds_on_a_wider_cpu() -> None:
    """CPUs without AVX-512 BF16 (AMD Zen 3, Intel client chips) take the AVX2 kernels; their tests run here
    with SPLITLLM_KERNELS=avx2, in a process of their own since the choice is made once per process."""
    env = {**os.environ, cpu_kernels.SWITCH: "avx2"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                          "tests/test_precision.py",
                          "-m", "not slow"], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:]


def _close(out: torch.Tensor, ref: torch.Tensor, tolerance: float) -> bool:
    return float((out.float() - ref.float()).norm() / ref.float().norm()) < tolerance


@needs_kernels
@pytest.mark.parametrize(
    ("form", "outputs", "inputs"),  # whole blocks; a ragged block (and an odd width where the form allows it)
    [("bfloat16", 96, 128), ("bfloat16", 7, 101), ("int8", 96, 128), ("int8", 7, 101), ("int4", 96, 128),
     ("int4", 7, 96)],
)
def test_blocked_linear_matches_reference_and_is_batch_invariant(form, outputs,  # type: ignore[no-untyped-def]
                                                                 inputs) -> None:
    gen = torch.Generator().manual_seed(0)
    w, bias = torch.randn(outputs, inputs, generator=gen) * 0.1, torch.randn(outputs, generator=gen)
    if form == "int8":
        stored = Int8Linear.quantize(w)
        linear = Int8Linear.from_stored(stored, bias, torch.device("cpu"))
        w = stored["q"].float() * stored["scales"].float()[:, None]
    elif form == "int4":
        stored = Int4Linear.quantize(w)
        linear = Int4Linear.from_stored(stored, bias, torch.device("cpu"))
        nibbles, sz = stored["nibbles"], stored["scales_mins"].float()
        q = torch.stack([nibbles >> 4, nibbles & 15], -1).view(outputs, inputs).float().view(outputs, -1, 32)
        w = (q * sz[..., :1] + sz[..., 1:]).view(outputs, inputs)
    else:
        linear = Precision(torch.bfloat16).linear({"weight": w.bfloat16()}, bias.bfloat16())
        w, bias = w.bfloat16().float(), bias.bfloat16().float()
    assert isinstance(linear, BlockedLinear) and linear.out_features == outputs
    assert torch.equal(linear.weight, w.bfloat16())
    x = torch.randn(1, 45, inputs, generator=gen).bfloat16()  # more rows than a pass (6 dot-product rows, 32 tile rows)
    out = linear(x)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 45, outputs)
    assert _close(out, x.float() @ w.T + bias, 0.01)
    assert torch.equal(out[0], torch.cat([linear(row) for row in x[0].split(1)]))
    assert torch.equal(out[0, 5:9], linear(x[0, 5:9]))
    assert torch.equal(out[0, 3:40], linear(x[0, 3:40]))  # a pass of two tiles, then a part of one
    assert linear(x.float()).dtype == torch.float32  # the input's dtype back, computed in bfloat16


@needs_kernels
def test_tiles_follow_the_cpu_and_the_switch() -> None:
    """AMX's tiles run the bfloat16, int8 and int4 linears where the CPU has them, unless SPLITLLM_TILES=0."""
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
    wanted = {"amx_tile", "amx_bf16"} <= set(flags) and os.environ.get("SPLITLLM_TILES") != "0"
    wanted = wanted and cpu_kernels.chosen().name == "avx512"  # the tile path is the AVX-512 build's
    assert KERNELS.tiles_available() == wanted
    assert cpu_kernels.linear_path() == ("amx-tiles" if wanted else cpu_kernels.chosen().path)  # what benchmarks record


@pytest.mark.slow  # a pytest run of its own
@needs_kernels
def test_the_dot_product_path_holds_without_tiles() -> None:
    """CPUs without AMX (AMD Zen 4) take the dot-product path for every linear; it runs here with the tiles
    switched off, in a process of its own since the choice is made once per process."""
    env = {**os.environ, "SPLITLLM_TILES": "0"}
    tests = "tiles_follow or blocked_linear or kernel_stage_is_batch or kernel_stage_matches"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", tests],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:]


@needs_kernels
def test_linear_kernel_rejects_what_does_not_fit() -> None:
    """A malformed call raises instead of reading past its tensors."""
    packed = KERNELS.pack(torch.zeros(40, 64, dtype=torch.bfloat16))  # two blocks of 32 outputs
    int8 = KERNELS.pack(torch.zeros(40, 64, dtype=torch.int8))
    int4, sz = KERNELS.pack_int4(torch.zeros(40, 64, dtype=torch.uint8), torch.zeros(40, 2, 2, dtype=torch.float16))
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    for args, said in [
        ((x[:, :62].contiguous(), packed, 40, None, None), "input width 62 and 40 outputs"),
        ((x, packed, 65, None, None), "input width 64 and 65 outputs"),
        ((x.float(), packed, 40, None, None), "bfloat16 input"),
        ((x[0, 0], packed, 40, None, None), "bfloat16 input"),
        ((x, packed, 40, torch.zeros(39), None), "one value per output"),
        ((x, packed, 40, None, torch.ones(40)), "bfloat16 weights none"),
        ((x, int8, 40, None, torch.ones(39)), "one value per output"),
        ((x, int4, 40, None, sz[:1].contiguous()), "scales and minimums"),
    ]:
        with pytest.raises(RuntimeError, match=said):
            KERNELS.linear(*args)
    assert KERNELS.linear(x, int4, 40, None, sz).shape == (3, 40)


def _cache(heads: int, length: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a larger cache buffer, as a layer's cache is."""
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, 1, heads, length + 7, dim, generator=gen)
    return k[:, :, :length], v[:, :, :length]


@needs_kernels
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "n"),
                         [(9, 3, 64, 1), (9, 3, 64, 13), (4, 1, 256, 6), (2, 2, 128, 3)])
def test_attention_kernel_matches_pytorch(heads, kv_heads, dim, n) -> None:  # type: ignore[no-untyped-def]
    k, v = _cache(kv_heads, 40 + n, dim, seed=1)
    q = torch.randn(1, n, heads, dim, generator=torch.Generator().manual_seed(2)).transpose(1, 2)
    mask = torch.zeros(n, 40 + n)
    mask[:, 40:] = torch.triu(torch.full((n, n), float("-inf")), 1)
    mask[0, :3] = float("-inf")  # a window edge
    for m in (mask[None, None], None):
        out = KernelAttention(KERNELS)(q, k, v, m, 0.2)
        assert out.shape == (1, n, heads * dim)
        assert torch.allclose(out, torch_attention(q, k, v, m, 0.2), atol=2e-6, rtol=1e-5)


@needs_kernels
def test_attention_kernel_rejects_what_does_not_fit() -> None:
    """A malformed call raises instead of reading past its tensors (values shorter or with fewer heads
    than the keys, a batch, heads that do not group, a mask of another size)."""
    k, v = _cache(3, 10, 64, seed=8)
    q, mask = torch.randn(1, 6, 2, 64), torch.zeros(1, 1, 2, 10)
    for args, said in [
        ((q, k, v[:, :, :9], mask), "must have one shape and layout"),
        ((q, k, v[:, :1], mask), "must have one shape and layout"),
        ((q, k, v.contiguous(), mask), "must have one shape and layout"),
        ((q, torch.cat([k, k]), torch.cat([v, v]), mask), r"\(1, kv heads, length, head size\)"),
        ((torch.cat([q, q]), k, v, mask), r"queries \(1, heads, n, head size\)"),
        ((q.double(), k, v, mask), "float32 queries"),
        ((q[:, :4], k, v, mask), "4 query heads are not a multiple of 3"),
        ((q, k[:, :0], v[:, :0], mask), "not a multiple of 0"),
        ((q[..., :32], k[..., :32], v[..., :32], mask), "positive multiple of 64"),
        ((q, k, v, mask[..., :9]), r"mask must be float32 \(n, length\) = \(2, 10\)"),
        ((q, k, v, torch.zeros(0, 2, 10)), "mask must be"),
    ]:
        with pytest.raises(RuntimeError, match=said):
            KERNELS.attention(*args, 0.125)
    assert KERNELS.attention(q, k, v, mask, 0.125).shape == (1, 2, 6 * 64)


@needs_kernels
def test_attention_kernel_row_is_the_same_in_a_tree_and_after_committing() -> None:
    """Node 5 of a tree sees the cache and nodes 0, 2, 4; sequentially those were committed first."""
    attention = KernelAttention(KERNELS)
    k, v = _cache(3, 106, 64, seed=3)
    q = torch.randn(1, 9, 6, 64, generator=torch.Generator().manual_seed(4))
    sees = [0, 2, 4, 5]
    mask = torch.full((6, 106), float("-inf"))
    mask[:, :100] = 0
    for node, ancestors in enumerate([[0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4], sees]):
        mask[node, [100 + a for a in ancestors]] = 0
    tree = attention(q, k, v, mask[None, None], None)
    committed = [torch.cat([t[:, :, :100], t[:, :, [100 + a for a in sees]]], 2) for t in (k, v)]
    alone = attention(q[:, :, 5:], *committed, None, None)
    assert torch.equal(tree[:, 5:], alone)


@needs_kernels
def test_attention_kernel_serves_prompts_and_leaves_other_head_sizes_to_pytorch() -> None:
    """A prompt row scores the same alone as in a step that also carries a speculative tree (the first
    step of a speculative generation sends both)."""
    attention = KernelAttention(KERNELS)
    k, v = _cache(2, 90, 64, seed=5)
    q = torch.randn(1, 4, 90, 64, generator=torch.Generator().manual_seed(6))
    causal = torch.triu(torch.full((90, 90), float("-inf")), 1)
    with_tree = attention(q, k, v, causal[None, None], None)
    prompt = attention(q[:, :, :70], k[:, :, :70], v[:, :, :70], causal[None, None, :70, :70], None)
    assert torch.equal(with_tree[:, :70], prompt)
    assert not KernelAttention.supports(16, torch.float32) and not KernelAttention.supports(64, torch.bfloat16)
    assert isinstance(Precision(torch.bfloat16).attention(64), KernelAttention)
    assert Precision(torch.float32).attention(64) is torch_attention  # the exact mode attends as transformers does
    expected = F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2).reshape(1, 90, -1)
    assert torch.equal(torch_attention(q, k, v, None, None), expected)


def _stage(path, precision: Precision, use_kernel_stage: bool) -> Stage:  # type: ignore[no-untyped-def]
    files = ModelFiles(path)
    stage = Stage.load(files, 1, files.config.num_layers - 1, precision)
    stage.use_kernel_stage = use_kernel_stage
    return stage


def _prompt_and_step(stage: Stage, seed: int, prompt: int = 20, n: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """The stage's outputs for a prompt, then for a tree of n nodes over it (node i's parent: i // 2)."""
    gen = torch.Generator().manual_seed(seed)
    d = stage.cfg.hidden_size
    cache = stage.new_cache(prompt + n)
    first = stage(cache, Step(torch.randn(prompt, d, generator=gen), torch.arange(prompt), Visibility.chain(prompt)))
    parents = [-1] + [i // 2 for i in range(n - 1)]
    vis = Visibility.from_parents(parents)
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    positions = prompt + torch.tensor(depth)
    return first, stage(cache, Step(torch.randn(n, d, generator=gen), positions, vis, range(prompt)))


@needs_kernels
@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
@pytest.mark.parametrize("model", ["mistral", "gemma3"])  # Gemma: q/k and sandwich norms, GELU, two kinds of layer
def test_kernel_stage_matches_layer_by_layer(model, quant, tiny_models) -> None:  # type: ignore[no-untyped-def]
    precision = Precision(torch.bfloat16, quant)
    in_kernels, layered = (_stage(tiny_models[model], precision, use) for use in (True, False))
    exact = _stage(tiny_models[model], Precision(), False)
    assert in_kernels.runs_kernel_stage and not layered.runs_kernel_stage
    for outs in zip(*(_prompt_and_step(s, seed=7) for s in (in_kernels, layered, exact))):
        kernel_out, layered_out, reference = (o.float() for o in outs)
        assert kernel_out.dtype == torch.float32 and kernel_out.shape == reference.shape
        # Both round to bfloat16 at slightly different places: the kernel stage as close to float32 as the
        # layers (2-9% on these tiny models, whose wide random weights amplify rounding).
        assert _close(kernel_out, layered_out, 0.05)
        assert _close(kernel_out, reference, 1.25 * float((layered_out - reference).norm() / reference.norm()))


@needs_kernels
def test_kernel_stage_is_batch_invariant(tiny_models) -> None:  # type: ignore[no-untyped-def]
    """Two sessions' steps in one call give each the bits it gets alone, whatever the other's length."""
    stage = _stage(tiny_models["gemma3"], Precision(torch.bfloat16, "int8"), True)
    d = stage.cfg.hidden_size
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randn(n, d, generator=gen) for n in (9, 14)]

    def steps(caches) -> list[tuple[KVCache, Step]]:  # type: ignore[no-untyped-def]
        return [(c, Step(h, torch.arange(len(h)), Visibility.chain(len(h)))) for c, h in zip(caches, prompts)]

    together = stage.forward_many(steps([stage.new_cache(16), stage.new_cache(16)]))
    alone = [stage.forward_many([s])[0] for s in steps([stage.new_cache(16), stage.new_cache(16)])]
    assert all(torch.equal(a, b) for a, b in zip(together, alone))


@needs_kernels
def test_kernel_stage_rejects_what_does_not_fit() -> None:
    shape = KERNELS.Shape(hidden=64, heads=2, kv_heads=1, head_dim=64, intermediate=64, eps=1e-5, scale=0.125,
                          gelu=False)

    def projection(outputs: int, inputs: int) -> object:
        return KERNELS.Projection(KERNELS.pack(torch.zeros(outputs, inputs, dtype=torch.bfloat16)), outputs, None, None)

    norm = torch.ones(64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="projection shapes"):
        KERNELS.Layer(shape, projection(128, 64), projection(64, 128), projection(128, 64), projection(64, 64),
                      norm, norm, None, None, None, None, 0)
    layer = KERNELS.Layer(shape, projection(256, 64), projection(64, 128), projection(128, 64), projection(64, 64),
                          norm, norm, None, None, None, None, 0)
    cache = torch.zeros(1, 1, 1, 4, 64)
    table = torch.zeros(3, 64)
    sequence = KERNELS.Sequence(row=0, count=3, offset=2, k=cache, v=cache, cos=[table], sin=[table], masks=[None])
    with pytest.raises(RuntimeError, match="room for the step"):  # 2 + 3 entries in a cache of 4
        KERNELS.decode(shape, [layer], torch.zeros(3, 64, dtype=torch.bfloat16), [sequence])
    fits = KERNELS.Sequence(row=0, count=3, offset=1, k=cache, v=cache, cos=[table], sin=[table], masks=[None])
    with pytest.raises(RuntimeError, match="cover every row"):
        KERNELS.decode(shape, [layer], torch.zeros(4, 64, dtype=torch.bfloat16), [fits])
    wider = KERNELS.Shape(hidden=128, heads=2, kv_heads=1, head_dim=64, intermediate=64, eps=1e-5, scale=0.125,
                          gelu=False)
    with pytest.raises(RuntimeError, match="projection shapes"):  # a layer built for another shape
        KERNELS.decode(wider, [layer], torch.zeros(3, 128, dtype=torch.bfloat16), [fits])
    for k, v, masks, said in [
        (cache, torch.zeros(1, 1, 1, 6, 64), [None], "of one shape"),  # values laid out unlike keys
        (cache[:, :0], cache[:, :0], [None], "key and value caches"),
        (cache, cache, [torch.zeros(0, 3, 4)], "masks must be"),
    ]:
        malformed = KERNELS.Sequence(row=0, count=3, offset=1, k=k, v=v, cos=[table], sin=[table], masks=masks)
        with pytest.raises(RuntimeError, match=said):
            KERNELS.decode(shape, [layer], torch.zeros(3, 64, dtype=torch.bfloat16), [malformed])
    assert KERNELS.decode(shape, [layer], torch.zeros(3, 64, dtype=torch.bfloat16), [fits]).shape == (3, 64)


@needs_kernels
def test_a_stages_weights_share_one_huge_page_mapping(tiny_models) -> None:  # type: ignore[no-untyped-def]
    stage = Stage.load(ModelFiles(tiny_models["mistral"]), 1, 4, Precision(torch.bfloat16, "int8"))
    linears = [m for layer in stage.layers for m in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
    assert len({m.packed.untyped_storage().data_ptr() for m in linears}) == 1
    x = torch.randn(3, stage.cfg.hidden_size).bfloat16()
    before = linears[4](x)  # the second layer's q|k|v
    on_huge_pages(linears[4:5])  # moved again: the same weights, the same bits
    assert linears[4].packed.untyped_storage().data_ptr() != linears[3].packed.untyped_storage().data_ptr()
    assert torch.equal(linears[4](x), before)


def test_the_kernels_report_sets_each_variant_beside_its_own_llama_cpp_build() -> None:
    """`bench kernels`: the AVX2 kernels are compared with llama.cpp kept to AVX2 on a wider CPU and with the
    native build on an AVX2-only one; a missing build said so."""
    from splitllm.lab import peers
    from splitllm.lab.bench.kernels import _ratios, markdown

    here = [v.name for v in cpu_kernels.runnable()]
    assert peers.matching("avx2") == ("avx2" if here[:1] == ["avx512"] else "native")
    assert peers.matching("avx512") == peers.matching("neon") == "native"

    settings = ("bfloat16-mixed", "bfloat16-int8", "bfloat16-int4")
    splitllm = {"avx512": dict(zip(settings, ({"tokens_per_second": t} for t in (220.0, 200.0, 240.0)))),
                "avx2": dict(zip(settings, ({"tokens_per_second": t} for t in (140.0, 150.0, 160.0))))}
    llama = {"native": {"tokens_per_second": 160.0}, "avx2": {"skipped": "no llama.cpp build"}}
    builds = {"avx512": "native", "avx2": "avx2"}  # as on a CPU with AVX-512
    ratios = _ratios(splitllm, llama, builds)
    assert ratios["avx512"] == {"fastest_setting": "bfloat16-int4", "default": 1.375, "fastest": 1.5}  # default: mixed
    assert ratios["avx2"] == {"fastest_setting": "bfloat16-int4", "default": None, "fastest": None}
    result = {"settings": {"settings": list(settings), "max_new_tokens": 64, "llama_cpp_builds": builds},
              "models": {"default": {"splitllm": splitllm, "llama_cpp": llama, "against_llama_cpp": ratios}}}
    table = markdown(result)
    assert "| avx512 | 220.00 | 200.00 | 240.00 | 160.00 (native) | 1.38x |" in table
    assert "| avx2 | 140.00 | 150.00 | 160.00 | not built | - |" in table
