"""How one side computes: compute dtype, weight quantization and device, chosen once at load.

A `Precision` is a property of a Stage (and of the client's embedding and LM head); the decoder math
never branches on it, it only calls the linear modules and dtypes the precision built. float32 with
no quantization is the exact mode: bit-identical to transformers' greedy decoding.
float64 exists for reference computations in tests.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
from torch import nn

from splitllm.kernels import cpu_kernels
from splitllm.model.attention import Attention, KernelAttention, torch_attention
from splitllm.model import quant
from splitllm.model.quant import QUANTIZED, BlockedLinear, Linear, PackedLinear

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
_SIXTEEN_BIT = (torch.bfloat16, torch.float16)
QUANTS = ("none", "int8", "int4", "mixed")
DEVICES = ("cpu", "cuda", "mps")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Precision:
    dtype: torch.dtype = torch.float32
    quant: str = "none"
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES.values():
            raise ValueError(f"compute dtype must be one of {', '.join(DTYPES)}, got {self.dtype}")
        if self.quant not in QUANTS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTS)}, got {self.quant!r}")
        if self.device.split(":")[0] not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")

    @classmethod
    def parse(cls, dtype: str = "float32", quant: str = "none", device: str = "cpu") -> Precision:
        """From command-line names, with an error that lists the choices."""
        if dtype not in DTYPES:
            raise ValueError(f"compute dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        return cls(DTYPES[dtype], quant, device)

    @classmethod
    def from_name(cls, name: str) -> Precision:
        """'bfloat16-int8' -> Precision: the inverse of `name` (on the CPU)."""
        dtype, _, quant = name.partition("-")
        return cls.parse(dtype, quant or "none")

    @classmethod
    def of(cls, spec: Precision | torch.dtype) -> Precision:
        """A bare dtype means dense weights on the CPU."""
        return spec if isinstance(spec, Precision) else cls(spec)

    @property
    def exact(self) -> bool:
        """Computes on the checkpoint's own values (float64 is for reference computations in tests)."""
        return self.dtype not in _SIXTEEN_BIT and self.quant == "none"

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def attention_dtype(self) -> torch.dtype:
        """CPU attention runs in float32: its 16-bit kernels are several times slower for a few query rows."""
        return torch.float32 if self.torch_device.type == "cpu" and self.dtype in _SIXTEEN_BIT else self.dtype

    def attention(self, head_dim: int) -> Attention:
        """The attention a layer of this precision runs: the CPU kernel for 16-bit compute where it runs
        (`attention.py`), else PyTorch's (always for the exact mode)."""
        kernels = cpu_kernels.load() if self.torch_device.type == "cpu" and not self.exact else None
        if kernels is None and self.torch_device.type == "cpu" and self.dtype in _SIXTEEN_BIT:
            _warn_without_kernels(self.name)
        if kernels is not None and KernelAttention.supports(head_dim, self.attention_dtype):
            return KernelAttention(kernels)
        return torch_attention

    @property
    def dtype_name(self) -> str:
        """'bfloat16': the compute dtype as `--dtype` and the wire name it."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def name(self) -> str:
        """'bfloat16-int8': names the stored form of the weights (the device does not change it)."""
        return f"{self.dtype_name}-{self.quant}"

    def serve_args(self) -> list[str]:
        """The `splitllm serve` options that give a server this precision."""
        return ["--dtype", self.dtype_name, "--quant", self.quant, "--device", self.device]

    def store_linear(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors a linear weight is kept as on disk in this precision."""
        if self.quant == "none":
            return {"weight": weight.to(self.dtype)}
        if self.quant == "mixed":
            return quant.store_mixed(weight)
        return QUANTIZED[self.quant].quantize(weight)

    def linear(self, stored: dict[str, torch.Tensor], bias: torch.Tensor | None = None) -> nn.Module:
        """The running module of a stored linear weight, on this precision's device."""
        dev = self.torch_device
        bias = None if bias is None else bias.to(dev, self.dtype)
        if self.quant == "none":
            weight = stored["weight"].to(dev, self.dtype)
            for fast in (BlockedLinear, PackedLinear):  # the fastest bfloat16 CPU kernel that runs here
                if fast.available(self.dtype, dev):
                    return fast(weight, bias)
            return Linear(weight, bias)
        return quant.from_stored(stored, bias, dev)

    def dense(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.torch_device, self.dtype)


EXACT = Precision()


def fastest(device: str = "cpu") -> Precision:
    """The fastest setting this machine runs well, what every command and `SplitClient` use unless told.

    On a CPU where splitllm's kernels load: bfloat16 compute with `mixed` weights, the fastest setting
    every kernel variant runs (`splitllm bench kernels`), and closer to float32 than int8 (`bench
    quality`): the weights a GGUF ships in 4-bit blocks stay exact in int4, at half of int8's bytes, and
    the others are int8 (figures in `docs/precision.md`). Elsewhere the exact mode: PyTorch's 16-bit
    kernels are no faster there and no more exact (neither speculates), and other devices are not verified.
    """
    if device == "cpu" and cpu_kernels.load() is not None:
        return Precision(torch.bfloat16, "mixed", device)
    return Precision(device=device)


def asked(dtype: torch.dtype | None, quant: str | None, device: str = "cpu") -> Precision:
    """A side's precision from its dtype and quantization, None where not given: neither given is the
    fastest here; one given alone takes the exact mode's other (the rule of every command and record)."""
    if dtype is None and quant is None:
        return fastest(device)
    return Precision(dtype or EXACT.dtype, quant or EXACT.quant, device)


@functools.cache
def _warn_without_kernels(name: str) -> None:
    """Said once per setting and process: the 16-bit settings are only bit-exact in splitllm's kernels."""
    log.warning(
        "%s runs in PyTorch's kernels (splitllm's do not run here): slower, and speculative decoding is not "
        "bit-exact against sequential decoding there, so auto decodes sequentially", name,
    )
