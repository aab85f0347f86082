"""Our view of a Hugging Face decoder config: only what the decoder math needs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Llama-family decoder (Llama, Mistral, Qwen2)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    tie_word_embeddings: bool
    max_position: int
    # Per layer: the sliding attention window in tokens, or None for full attention.
    layer_windows: tuple[int | None, ...]
    # Rotary inverse frequencies and the cos/sin scale, as the HF rope type defines them.
    rope_inv_freq: tuple[float, ...]
    rope_scaling: float

    @classmethod
    def from_hf(cls, hf: PretrainedConfig) -> ModelConfig:
        if hf.model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {hf.model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        inv_freq, scaling = _rope_parameters(hf, head_dim)
        return cls(
            model_type=hf.model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            qkv_bias=hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            max_position=hf.max_position_embeddings,
            layer_windows=_layer_windows(hf),
            rope_inv_freq=tuple(inv_freq.tolist()),
            rope_scaling=float(scaling),
        )

    def check_split(self, head: int, tail: int) -> None:
        """Refuse partitions that would leave a side without layers it must have."""
        n = self.num_layers
        if head < 1 or tail < 0 or head + tail >= n:
            raise ValueError(
                f"invalid split head={head} tail={tail}: the model has {n} layers; need head >= 1, "
                f"tail >= 0 and head + tail < {n} so the server keeps at least one layer"
            )


def _layer_windows(hf: PretrainedConfig) -> tuple[int | None, ...]:
    window = getattr(hf, "sliding_window", None)
    types = getattr(hf, "layer_types", None)
    if types is not None:
        return tuple(window if t == "sliding_attention" else None for t in types)
    return (window,) * hf.num_hidden_layers


def _rope_parameters(hf: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies through transformers' own rope functions, so every rope type matches HF."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv, 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ValueError(f"unsupported rope type {rope_type!r}")
    return ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
