"""Linear layers in the form their weights are stored: dense, int8 per output channel, int4 grouped.

Weight-only quantization as gpt-fast does it: the weights are streamed from memory as 8 or 4 bits and
multiplied by 16-bit activations in packed kernels (splitllm's own where a variant runs: AVX-512 BF16,
AVX2 with FMA, or ARM NEON; else PyTorch's), so a one-token step reads 2-3x fewer bytes than with
bfloat16 weights and 4-6x fewer than with float32. Each module's `stored` form (plain tensors, device
independent) is what the conversion cache keeps; `from_stored` builds the running module on a device.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from splitllm.kernels import cpu_kernels

# The packed kernels take bfloat16 activations on CPU (float32 / float16 inputs run many times slower there).
KERNEL_DTYPE = torch.bfloat16
# A weight's index in `Variant.shared_rows` by its dtype (any other: bfloat16, 0).
WEIGHT_KINDS = {torch.int8: 1, torch.uint8: 2}
INT4_GROUP = 32  # inputs per int4 scale: gpt-fast's smallest group, the most accurate


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype, skipping the dispatch when it already is (a step makes hundreds of these calls)."""
    return x if x.dtype == dtype else x.to(dtype)


class Linear(nn.Module):
    """y = x W^T + b with dense weights in the compute dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PackedLinear(nn.Module):
    """bfloat16 weights laid out once, at load, in oneDNN's blocked format for its CPU kernel.

    Same bits as `F.linear` in bfloat16 for any number of rows (so any batch of verification rows
    scores like sequential steps), and faster than `F.linear` for the few rows of a decoding step
    (docs/precision.md has the kernels' measured speeds).
    """

    packed: torch.Tensor  # the buffers __init__ registers
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self._out = weight.shape[0]
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.to(torch.bfloat16).contiguous()))
        self.register_buffer("bias", bias)

    @staticmethod
    def available(dtype: torch.dtype, device: torch.device) -> bool:
        return (
            dtype == torch.bfloat16 and device.type == "cpu" and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        )

    @property
    def out_features(self) -> int:
        return self._out

    @property
    def weight(self) -> torch.Tensor:
        """The dense (out, in) weight, rebuilt from the packed layout (a copy: for reading rows, not for steps)."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(_cast(x, torch.bfloat16), self.packed, self.bias, "none", [], "")


class BlockedLinear(nn.Module):
    """Weights in the blocks of splitllm's own CPU kernel: bfloat16, int8 with per-output scales, or
    int4 with a scale and minimum per output and group of `INT4_GROUP` inputs.

    Where it runs (`cpu_kernels`), it streams a step's weights at the memory bandwidth (faster than
    PyTorch's kernels for the few rows of a decoding step; docs/precision.md, *Linear*) and gives every
    row the same bits alone or in any batch. Its sums run in a different order from oneDNN's, so bits
    differ from `F.linear` (by bfloat16 rounding).
    `scales` is the int8 per-output float32 vector or the int4 kernel's packed float16 scales and minimums.
    """

    packed: torch.Tensor  # the buffers __init__ registers
    scales: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 scales: torch.Tensor | None = None) -> None:
        """weight (out, in): float (run in bfloat16); int8 with float32 `scales` (out,); or uint8 values
        0..15 with `scales` the (out, in / INT4_GROUP, 2) scales and minimums of w = q * scale + min."""
        super().__init__()
        kernels = cpu_kernels.load()
        if kernels is None:
            raise RuntimeError("splitllm's CPU kernels do not run on this machine (see BlockedLinear.available)")
        self._kernels = kernels
        self._out, self._in = weight.shape
        # Rows that cost about one on the dot-product path (`Variant.shared_rows`): the kernel reads each
        # weight block once for a few rows, so while bandwidth bounds it they come almost free.
        variant = cpu_kernels.chosen()
        assert variant is not None  # the kernels loaded
        self._dot_rows = variant.shared_rows[WEIGHT_KINDS.get(weight.dtype, 0)]
        if weight.dtype == torch.uint8:
            assert scales is not None  # int4 weights come with their scales and minimums
            packed, scales = kernels.pack_int4(weight.contiguous(), scales.to(torch.float16).contiguous())
        else:
            dense = weight.contiguous() if weight.dtype == torch.int8 else weight.to(torch.bfloat16).contiguous()
            packed = kernels.pack(F.pad(dense, (0, self._in % 2)))
            scales = None if scales is None else scales.float().contiguous()
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())

    @staticmethod
    def available(dtype: torch.dtype, device: torch.device) -> bool:
        return dtype == torch.bfloat16 and device.type == "cpu" and cpu_kernels.load() is not None

    @property
    def shared_rows(self) -> int:
        """How many rows one call takes for about the cost of one: a pass of the tile kernel (32 rows,
        two tiles of 16) where AMX runs it; on the dot-product path the few rows that share each read of
        the weights while the memory's bandwidth bounds the kernel."""
        return 32 if self._kernels.tiles_available() and (self._in + self._in % 2) % 32 == 0 else self._dot_rows

    @property
    def out_features(self) -> int:
        return self._out

    @property
    def in_features(self) -> int:
        return self._in

    @property
    def weight(self) -> torch.Tensor:
        """The (out, in) bfloat16 weight the kernel multiplies by (a copy: for reading rows, not for steps)."""
        return self._kernels.unpack(self.packed, self._out, self.scales)[:, : self._in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """In the input's dtype, computed in bfloat16 (as the quantized kernels do)."""
        flat = _cast(x, torch.bfloat16).contiguous()
        if self._in % 2:
            flat = F.pad(flat, (0, 1))
        return _cast(self._kernels.linear(flat, self.packed, self._out, self.bias, self.scales), x.dtype)


_TRIM_EVERY = 8 << 20  # bytes moved between handing freed memory back


def on_huge_pages(modules: Iterable[nn.Module]) -> None:
    """Move the packed weights of the `BlockedLinear`s among `modules` into one anonymous mapping advised
    for transparent huge pages (Linux; elsewhere, or for other modules, nothing changes).

    A step streams every weight once: on 4 KiB pages that is a TLB miss every 4 KiB and the hardware
    prefetcher stopping at each page edge. Huge pages make a one-position step faster and steadier
    between processes (measured in docs/precision.md, *Huge pages*). Weights
    are copied once and the old storage freed (and handed back to the system as the copy proceeds, so
    memory does not peak at two copies); the modules stay as they were otherwise.
    """
    linears = [m for m in modules if isinstance(m, BlockedLinear)]
    if not linears or not hasattr(mmap, "MADV_HUGEPAGE"):
        return
    align = 64  # a cache line: blocks start where a load does
    offsets, total = [], 0
    for m in linears:
        offsets.append(total)
        total += -(-m.packed.nbytes // align) * align
    memory = mmap.mmap(-1, total)
    memory.madvise(mmap.MADV_HUGEPAGE)  # before the first touch, so faults take huge pages
    arena = torch.frombuffer(memory, dtype=torch.uint8)  # keeps the mapping alive
    moved = 0
    for m, offset in zip(linears, offsets):
        view = arena[offset : offset + m.packed.nbytes].view(m.packed.dtype).view(m.packed.shape)
        view.copy_(m.packed)
        moved += m.packed.nbytes
        m.packed = view
        if moved >= _TRIM_EVERY:  # the old copies back to the system as we go: memory peaks at one copy
            _release_freed_memory()
            moved = 0
    _release_freed_memory()


def _release_freed_memory() -> None:
    """Return memory freed to the C heap to the system (glibc keeps freed chunks of a few MiB otherwise)."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


class Int8Linear(nn.Module):
    """Symmetric int8 weights with one scale per output channel: w ~= q * scale."""

    q: torch.Tensor  # the buffers __init__ registers
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("q", q)
        self.register_buffer("scales", scales.to(KERNEL_DTYPE))
        self.register_buffer("bias", bias)

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    @staticmethod
    def quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
        w = w.float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return {"q": q, "scales": scales.to(KERNEL_DTYPE)}

    @classmethod
    def from_stored(cls, stored: dict[str, torch.Tensor], bias: torch.Tensor | None, device: torch.device) -> nn.Module:
        """splitllm's kernel where it runs (faster than PyTorch's int8 kernel for a one-position step;
        docs/precision.md), else PyTorch's."""
        if BlockedLinear.available(KERNEL_DTYPE, device):
            return BlockedLinear(stored["q"], bias, stored["scales"])
        return cls(stored["q"].to(device), stored["scales"].to(device), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = _cast(x.reshape(-1, x.shape[-1]), KERNEL_DTYPE)
        y = _cast(torch.ops.aten._weight_int8pack_mm(flat, self.q, self.scales).view(*x.shape[:-1], -1), x.dtype)
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    """Asymmetric 4-bit weights in groups of INT4_GROUP inputs: w = q * scale + min, q in 0..15.

    The form of GGUF's 4-bit blocks (Q4_0, Q4_1, and Q4_K's sub-blocks of 32), so a model shipped in one
    of them keeps its weights (`quantize` finds each block's grid again in the float32 conversion).
    """

    packed: torch.Tensor  # the buffers __init__ registers
    scales_zeros: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros)
        self._out = out_features
        self.register_buffer("bias", bias)

    @property
    def out_features(self) -> int:
        return self._out

    @staticmethod
    def quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
        """Nibbles packed two per byte (out, in / 2) and (out, in / group, 2) float16 scales and minimums.

        A group whose values already lie on a grid of at most 16 evenly spaced levels keeps that grid, so
        a converted GGUF 4-bit block comes back as it was shipped (to float16's rounding of its scale and
        minimum; exactly for Q4_0 and Q4_1, whose scales are float16); any other group is spread over its
        own range, from its minimum to its maximum.
        """
        out, inp = w.shape
        if inp % INT4_GROUP:
            raise ValueError(f"int4 needs input widths divisible by {INT4_GROUP}, got {inp}")
        g = w.float().view(out, inp // INT4_GROUP, INT4_GROUP)
        low, high = g.amin(-1), g.amax(-1)
        step = _grid_step(g, low, high)
        scales, mins = step.half(), _grid_origin(low, high, step).half()
        q = torch.round((g - mins.float()[..., None]) / scales.float()[..., None])
        q = q.nan_to_num(0).clamp(0, 15).to(torch.uint8).view(out, inp)  # a constant group: scale 0, every q 0
        return {"nibbles": q[:, ::2] << 4 | q[:, 1::2], "scales_mins": torch.stack([scales, mins], -1)}

    @classmethod
    def from_stored(cls, stored: dict[str, torch.Tensor], bias: torch.Tensor | None, device: torch.device) -> nn.Module:
        """splitllm's kernel where it runs, else PyTorch's int4 kernel."""
        nibbles = stored["nibbles"]
        q = torch.stack([nibbles >> 4, nibbles & 15], -1).view(nibbles.shape[0], -1)
        if BlockedLinear.available(KERNEL_DTYPE, device):
            return BlockedLinear(q, bias, stored["scales_mins"])
        q = q.to(torch.int32)
        scales, mins = stored["scales_mins"].float().unbind(-1)  # PyTorch's kernels: (q - 8) * scale + zero
        sz = torch.stack([scales, mins + 8 * scales], -1).transpose(0, 1).contiguous().to(KERNEL_DTYPE)
        if device.type == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        else:  # the CUDA kernel's layout: uint8 pairs, 8 inner k tiles
            pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).to(device)
            packed = torch.ops.aten._convert_weight_to_int4pack(pairs, 8)
        return cls(packed.to(device), sz.to(device), q.shape[0], bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = _cast(x.reshape(-1, x.shape[-1]), KERNEL_DTYPE)
        if self.packed.device.type == "cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, INT4_GROUP, self.scales_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm(flat, self.packed, INT4_GROUP, self.scales_zeros)
        y = _cast(y.view(*x.shape[:-1], -1), x.dtype)
        return y if self.bias is None else y + self.bias


def _grid_step(g: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Per group of g (..., INT4_GROUP): the spacing of the evenly spaced grid of at most 16 levels from low
    that its values lie on (to 1% of a step), else (high - low) / 15. Tried: the smallest gap between
    distinct values, and its half and third (a grid whose neighbouring levels are never both used)."""
    ordered = g.sort(-1).values
    gaps = ordered.diff(dim=-1)
    smallest = torch.where(gaps > 0, gaps, torch.inf).amin(-1)
    step = (high - low) / 15
    for parts in (3, 2, 1):  # the widest spacing that fits wins, so it is tried last
        candidate = smallest / parts
        levels = (g - low[..., None]) / candidate[..., None]
        fits = (
            ((levels - levels.round()).abs() <= 0.01).all(-1) & (levels.amax(-1) <= 15.01) & torch.isfinite(candidate)
        )
        step = torch.where(fits, candidate, step)
    return step


def _grid_origin(low: torch.Tensor, high: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Where each group's grid starts: its lowest value, or a level below it that float16 holds exactly (a
    Q4_0 or Q4_1 block whose lowest levels are unused has its float16 minimum down there), so storing the
    minimum in float16 loses nothing."""
    used = torch.round((high - low) / step).nan_to_num(15)
    origin = low
    for below in range(15, 0, -1):  # the nearest such level wins, so it is tried last
        candidate = low - below * step
        origin = torch.where((candidate.half().float() == candidate) & (used + below <= 15), candidate, origin)
    return torch.where(low.half().float() == low, low, origin)


QUANTIZED: dict[str, type[Int8Linear] | type[Int4Linear]] = {"int8": Int8Linear, "int4": Int4Linear}
# How close int4 must come to a weight for `mixed` to keep it in 4 bits (relative mean square error): a GGUF
# 4-bit block found again is within float16's rounding of its scale (1e-6 or less), int8 is ~1e-4 away.
_LOSSLESS = 1e-5


def store_mixed(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """`mixed`: int4 where the weight already lies on 4-bit grids (a GGUF shipped it as Q4_0, Q4_1 or Q4_K),
    so nothing is lost; else int8 (a wider source, such as Q6_K or Q8_0, loses less there than in 4 bits)."""
    four = Int4Linear.quantize(weight)
    w = weight.float()
    if float((int4_values(four) - w).square().sum()) <= _LOSSLESS * float(w.square().sum()):
        return four
    return Int8Linear.quantize(weight)


def int4_values(stored: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float32 weight an int4 stored form stands for."""
    nibbles = stored["nibbles"]
    q = torch.stack([nibbles >> 4, nibbles & 15], -1).view(nibbles.shape[0], -1, INT4_GROUP).float()
    scales, mins = stored["scales_mins"].float().unbind(-1)
    return (q * scales[..., None] + mins[..., None]).view(nibbles.shape[0], -1)


def fuse(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stored linear weights concatenated along their outputs (a layer's q, k and v as one linear). Under
    `mixed` the parts may differ in form: then they are fused as int8, the wider one."""
    if any(p.keys() != parts[0].keys() for p in parts):
        parts = [Int8Linear.quantize(int4_values(p)) if "nibbles" in p else p for p in parts]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def from_stored(stored: dict[str, torch.Tensor], bias: torch.Tensor | None, device: torch.device) -> nn.Module:
    """The running module of a quantized stored weight, by its form (under `mixed`, each weight its own)."""
    form = Int4Linear if "nibbles" in stored else Int8Linear
    return form.from_stored(stored, bias, device)
