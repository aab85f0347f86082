"""A contiguous range of decoder layers with its own KV cache: the unit each side runs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import cast

import torch
from torch import nn

from splitllm.model.kv import KVCache
from splitllm.kernels import cpu_kernels
from splitllm.model.blocks import DecoderLayer, Rotary, Segment
from splitllm.model.config import ModelConfig
from splitllm.model.kernel_stage import KernelStage
from splitllm.model.precision import Precision
from splitllm.model.quant import on_huge_pages
from splitllm.weights.conversions import StoredWeights
from splitllm.weights.loaded import loaded_fingerprint
from splitllm.weights.sources import ModelFiles
from splitllm.model.visibility import Visibility

# Each linear attribute and the checkpoint modules it is made of (fused along the outputs).
_LINEARS = {
    "qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    "o_proj": ["self_attn.o_proj"],
    "gate_up": ["mlp.gate_proj", "mlp.up_proj"],
    "down": ["mlp.down_proj"],
}


def _norm_tensors(cfg: ModelConfig) -> dict[str, str]:
    """The layer's RMSNorm attributes and their tensors; with sandwich norms (Gemma) HF's
    `post_attention_layernorm` norms the attention output and `pre_feedforward_layernorm` the MLP input."""
    if not cfg.sandwich_norm:
        norms = {"input_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight"}
    else:
        norms = {
            "input_norm": "input_layernorm.weight",
            "attn_out_norm": "post_attention_layernorm.weight",
            "post_norm": "pre_feedforward_layernorm.weight",
            "mlp_out_norm": "post_feedforward_layernorm.weight",
        }
    if cfg.qk_norm:
        norms |= {"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}
    return norms


def _layer_tensors(cfg: ModelConfig, i: int) -> tuple[dict[str, str], dict[str, tuple[list[str], list[str] | None]]]:
    """Layer i's norm tensors, and its linear weights and biases, by the attribute each fills."""
    prefix = f"model.layers.{i}."
    norms = {attr: prefix + name for attr, name in _norm_tensors(cfg).items()}
    linears = {
        attr: ([f"{prefix}{m}.weight" for m in modules],
               [f"{prefix}{m}.bias" for m in modules] if attr == "qkv" and cfg.qkv_bias else None)
        for attr, modules in _LINEARS.items()
    }
    return norms, linears


def _linear_names(linears: dict[str, tuple[list[str], list[str] | None]]) -> list[str]:
    return [n for weight, bias in linears.values() for n in (*weight, *(bias or ()))]


def read_norm(weights: StoredWeights, name: str) -> torch.Tensor:
    """An RMSNorm weight with the config's offset added in float32 (Gemma's 1 + w), then cast."""
    weight = weights.dense([name])[name].float()
    return weights.precision.dense(weight + weights.files.config.norm_offset)


@dataclass(frozen=True)
class Step:
    """One sequence's step, as the client's stages, the middle and the server all take it.

    `inputs`: token ids (n,) for the embedding, or hidden states (n, d) entering a stage; `positions`
    (n,): their absolute positions; `vis`: which new entries each one sees; `keep`: the previous
    step's entries to commit first, in order (the rest are dropped). `crop`, before that: the committed
    length to cut the cache back to, dropping what is pending too (so `keep` is empty): a step sent
    ahead on a guess that failed is undone this way (decoding/ahead.py).
    """

    inputs: torch.Tensor
    positions: torch.Tensor
    vis: Visibility
    keep: Sequence[int] = ()  # any sequence in, a tuple kept (__post_init__)
    crop: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "keep", tuple(self.keep))

    @property
    def n(self) -> int:
        return self.positions.numel()

    def with_inputs(self, inputs: torch.Tensor) -> Step:
        """The same step carrying other inputs (what the previous stage made of them)."""
        return replace(self, inputs=inputs)

    def part(self, start: int, end: int, keep: Sequence[int]) -> Step:
        """Entries [start, end) as a step of their own that commits `keep` first (the first part crops
        as the step does); exact where every entry from `start` on sees every entry before it
        (`Visibility.cuts`)."""
        crop = self.crop if start == 0 else None
        return Step(self.inputs[start:end], self.positions[start:end], self.vis.part(start, end), keep, crop)


class Stage(nn.Module):
    """Layers [start, end) of a model; `forward` runs one step of n new positions over a cache.

    Weights are shared; each session brings its own cache (`new_cache`). `precision` (or a bare
    dtype: dense weights on the CPU) fixes how the stage stores and computes, once. Where the CPU
    kernels run this precision, a step goes through all layers in one call (`KernelStage`);
    `use_kernel_stage = False` runs it layer by layer instead (for comparison: the rounding differs slightly).
    """

    loaded_fingerprint: str  # set by `load`: the digest of the bytes the weights were built from (weights/loaded.py)

    def __init__(self, cfg: ModelConfig, start: int, end: int, precision: Precision | torch.dtype) -> None:
        super().__init__()
        if not 0 <= start < end <= cfg.num_layers:
            raise ValueError(f"layer range [{start}, {end}) is outside the model's {cfg.num_layers} layers")
        self.precision = Precision.of(precision)
        self.cfg, self.start, self.end, self.dtype = cfg, start, end, self.precision.dtype
        self.device = self.precision.torch_device
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.precision) for _ in range(start, end))
        # Layers of one kind (window, rotary) share a step's masks and cos/sin tables.
        kinds = list(zip(cfg.layer_windows[start:end], cfg.layer_ropes[start:end]))
        distinct = list(dict.fromkeys(kinds))
        self.layer_kinds = [distinct.index(k) for k in kinds]
        self.windows = [w for w, _ in distinct]
        self.rotaries = [Rotary(rope) for _, rope in distinct]
        self.use_kernel_stage = True

    def new_cache(self, max_context: int) -> KVCache:
        cfg = self.cfg
        # Kept in the attention's dtype, so a step converts only its new entries, never the whole cache.
        at = self.precision.attention_dtype
        return KVCache(self.end - self.start, cfg.num_kv_heads, cfg.head_dim, max_context, at, self.device)

    @classmethod
    def load(cls, files: ModelFiles, start: int, end: int, precision: Precision | torch.dtype) -> Stage:
        """Build the stage reading only its own layers' tensors, in the form `precision` stores them;
        `loaded_fingerprint` names the bytes they were built from (weights/loaded.py)."""
        stage = cls(files.config, start, end, precision)
        plans = [_layer_tensors(files.config, i) for i in range(start, end)]
        names = [n for norms, linears in plans for n in [*norms.values(), *_linear_names(linears)]]
        weights = StoredWeights(files, stage.precision, names)
        for (norms, linears), layer in zip(plans, stage.layers):
            for attr, name in norms.items():
                getattr(layer, attr).data = read_norm(weights, name)
            for attr, (weight, bias) in linears.items():
                setattr(layer, attr, weights.linear(weight, bias))
        layers = cast("Sequence[DecoderLayer]", stage.layers)
        on_huge_pages(m for layer in layers for m in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
        stage.loaded_fingerprint = loaded_fingerprint(files.config, (start, end), stage.precision.name, weights.digests)
        return stage

    def check_step(self, cache: KVCache, step: Step) -> None:
        """Validate a step before anything is mutated, so a bad request leaves the cache untouched."""
        n, hidden, positions = step.n, step.inputs, step.positions
        if hidden.shape != (n, self.cfg.hidden_size) or positions.shape != (n,) or step.vis.n != n:
            raise ValueError(
                f"a step of {n} positions needs hidden states of shape ({n}, {self.cfg.hidden_size}) and an "
                f"{n} x {n} visibility, got {tuple(hidden.shape)} and {step.vis.n} x {step.vis.n}"
            )
        if step.crop is not None:
            cache.check_crop(step.crop)
            if step.keep:
                raise ValueError("a step that crops the cache keeps nothing of the previous step (it is dropped)")
        else:
            cache.check_keep(step.keep)
        context = (cache.length if step.crop is None else step.crop) + len(step.keep)
        if context + n > cache.max_context:
            raise ValueError(
                f"step of {n} positions over a context of {context} exceeds the maximum context of {cache.max_context}"
            )
        if n and (int(positions.min()) < 0 or int(positions.max()) >= self.cfg.max_position):
            raise ValueError(f"positions must lie in [0, {self.cfg.max_position})")

    def forward(self, cache: KVCache, step: Step) -> torch.Tensor:
        """step.inputs: (n, d) states entering layer `start`; returns (n, d) states leaving layer `end - 1`.

        `step.crop` first cuts the cache back, `step.keep` commits the chosen entries of the previous
        step, then the n new positions are appended as this step's pending entries.
        """
        return self.forward_many([(cache, step)])[0]

    @torch.inference_mode()
    def forward_many(self, batch: Sequence[tuple[KVCache, Step]]) -> list[torch.Tensor]:
        """One step for each of several independent sequences (distinct caches) in one pass.

        The rows of all steps share every weight read; each attends only to its own cache and
        visibility. Every step is validated before any cache is touched.
        """
        if len({id(cache) for cache, _ in batch}) != len(batch):
            raise ValueError("a batch holds at most one step per cache")
        for cache, s in batch:
            self.check_step(cache, s)
        segments: list[list[Segment]] = [[] for _ in self.windows]
        row = 0
        for cache, s in batch:
            if s.crop is not None:
                cache.crop(s.crop)
            cache.keep(s.keep)
            cache.stage_new(s.positions)
            cache_pos = cache.positions[: cache.length]
            masks = {w: self._mask(s.vis, cache_pos, s.positions, w) for w in set(self.windows)}
            for segs, w, rotary in zip(segments, self.windows, self.rotaries):
                cos, sin = (t.to(self.device) for t in rotary(s.positions, self.precision.attention_dtype))
                segs.append(Segment(slice(row, row + s.n), cos, sin, masks[w], cache.length))
            row += s.n
        x = self.run_layers(torch.cat([s.inputs.to(self.device, self.dtype) for _, s in batch]), [c for c, _ in batch],
                            segments)
        return list(x.split([s.n for _, s in batch]))

    @torch.inference_mode()
    def extend(self, cache: KVCache, hidden: torch.Tensor, positions: torch.Tensor, sees: torch.Tensor) -> torch.Tensor:
        """Append n entries after everything in `cache` (the previous call's entries are kept first),
        run their states (n, d) through the layers and return the outputs; `sees` (n, length + n)
        says which entries each attends to (a sliding-window layer sees only those within its window).

        Drafting a tree depth by depth needs this: a node must see its ancestors, which earlier calls
        appended, but not their siblings, which `Visibility` (new positions only) cannot express.
        `cache.crop` drops the speculative entries afterwards.
        """
        cache.keep(range(cache.pending))
        n = positions.numel()
        if sees.shape != (n, cache.length + n):
            raise ValueError(
                f"visibility of {n} entries over {cache.length} cached ones must be ({n}, {cache.length + n})"
            )
        if n and int(positions.max()) >= self.cfg.max_position:
            raise ValueError(f"draft positions must lie below {self.cfg.max_position}")
        cache.stage_new(positions)
        keys = cache.positions[: cache.length + n]
        at = self.precision.attention_dtype
        segments = []
        for window, rotary in zip(self.windows, self.rotaries):
            cos, sin = (t.to(self.device) for t in rotary(positions, at))
            seen = sees if window is None else sees & (positions[:, None] - keys[None, :] < window)
            mask = torch.zeros(seen.shape, dtype=at).masked_fill_(~seen, float("-inf"))[None, None].to(self.device)
            segments.append([Segment(slice(0, n), cos, sin, mask, cache.length)])
        return self.run_layers(hidden, [cache], segments)

    def run_layers(self, hidden: torch.Tensor, caches: Sequence[KVCache],
                   segments: Sequence[Sequence[Segment]]) -> torch.Tensor:
        """The layers over (rows, d) states whose caches already hold this step's positions as pending
        entries; segments[kind][i]: sequence i's rows, rotary and mask for layers of that kind. For
        callers that build their own masks (a drafter's tree sees entries no `Visibility` describes)."""
        x = hidden.to(self.device, self.dtype)
        kernel_stage = self._active_kernel_stage()
        if kernel_stage is not None:
            return kernel_stage(x, caches, segments)
        x = x[None]
        for i, (layer, kind) in enumerate(zip(self.layers, self.layer_kinds)):
            kv = [c.layer(i, seg.rows.stop - seg.rows.start)[:2] for c, seg in zip(caches, segments[kind])]
            x = layer(x, segments[kind], kv)
        return x[0]

    @property
    def row_invariant(self) -> bool:
        """Whether a row's output bits are the same alone as in any step (what speculation's exactness needs):
        splitllm's kernel stage. PyTorch's kernels pick their blocking by the number of rows, so a row rounds
        differently in a tree than alone: in float32 by enough to flip a real model's near-ties. float64, the
        tests' reference, counts: it rounds 1e-16 per operation, nine orders below the closest such ties."""
        return not self.layers or self.runs_kernel_stage or self.dtype == torch.float64

    @property
    def runs_kernel_stage(self) -> bool:
        """Whether a step runs as one `KernelStage` call (else layer by layer)."""
        return self._active_kernel_stage() is not None

    def _active_kernel_stage(self) -> KernelStage | None:
        return self._kernel_stage if self.use_kernel_stage else None

    @cached_property
    def _kernel_stage(self) -> KernelStage | None:
        """The kernel stage, built on first use (weights load after __init__); None where it does not apply."""
        if self.precision.exact or self.precision.torch_device.type != "cpu":
            return None  # the exact mode never compiles the kernels
        kernels = cpu_kernels.load()
        layers = cast("Sequence[DecoderLayer]", self.layers)  # the ModuleList's items
        if kernels is None or not KernelStage.supports(self.cfg, layers, self.dtype):
            return None
        return KernelStage(kernels, self.cfg, layers, self.layer_kinds)

    def _mask(
        self, vis: Visibility, cache_positions: torch.Tensor, positions: torch.Tensor, window: int | None
    ) -> torch.Tensor | None:
        mask = vis.additive_mask(cache_positions, positions, window, self.precision.attention_dtype)
        return None if mask is None else mask.to(self.device)
