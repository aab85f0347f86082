"""Our view of a Hugging Face decoder config: only what the decoder math needs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PretrainedConfig

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "gemma3_text")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class Rope:
    """Rotary inverse frequencies and the cos/sin scale, as the HF rope type defines them."""

    inv_freq: tuple[float, ...] = field(repr=False)
    scaling: float


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a pre-norm decoder: the Llama family (Llama, Mistral, Qwen2) and Gemma 3.

    Gemma 3 differs only by the fields after `layer_ropes`; their defaults are the Llama family's.
    """

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
    # Per layer: its rotary (Gemma 3 gives sliding and full-attention layers different bases).
    layer_ropes: tuple[Rope, ...]
    # Added to every RMSNorm weight at load: Gemma scales by (1 + w).
    norm_offset: float = 0.0
    # RMSNorm of each head's query and key before rotary.
    qk_norm: bool = False
    # RMSNorm of the attention and MLP outputs before they join the residual ("sandwich" norms).
    sandwich_norm: bool = False
    # Token embeddings are multiplied by this (Gemma: sqrt(hidden_size), rounded to the compute dtype).
    embed_scale: float = 1.0
    hidden_act: str = "silu"
    # Softmax scale of attention scores; None is 1 / sqrt(head_dim).
    attn_scale: float | None = None
    # cap * tanh(logits / cap) on the LM head output, when set.
    final_logit_softcap: float | None = None

    @classmethod
    def from_hf(cls, hf: PretrainedConfig) -> ModelConfig:
        if hf.model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {hf.model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        gemma = hf.model_type == "gemma3_text"
        hidden_act = getattr(hf, "hidden_activation", None) or hf.hidden_act
        if hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {hidden_act!r}; supported: {', '.join(ACTIVATIONS)}")
        if getattr(hf, "attn_logit_softcapping", None) is not None or getattr(hf, "use_bidirectional_attention", False):
            raise ValueError("attention logit soft-capping and bidirectional attention are not supported")
        scalar = getattr(hf, "query_pre_attn_scalar", None)
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
            layer_ropes=_layer_ropes(hf, head_dim),
            norm_offset=1.0 if gemma else 0.0,
            qk_norm=gemma,
            sandwich_norm=gemma,
            embed_scale=hf.hidden_size**0.5 if gemma else 1.0,
            hidden_act=hidden_act,
            attn_scale=scalar**-0.5 if scalar is not None else None,
            final_logit_softcap=getattr(hf, "final_logit_softcapping", None),
        )

    def check_split(self, first: int, last: int) -> None:
        """Refuse partitions that would leave a side without layers it must have."""
        n = self.num_layers
        if first < 1 or last < 0 or first + last >= n:
            raise ValueError(
                f"invalid split first={first} last={last}: the model has {n} layers; need first >= 1, "
                f"last >= 0 and first + last < {n} so the server keeps at least one layer"
            )


def _layer_windows(hf: PretrainedConfig) -> tuple[int | None, ...]:
    window = getattr(hf, "sliding_window", None)
    types = getattr(hf, "layer_types", None)
    if types is not None:
        return tuple(window if t == "sliding_attention" else None for t in types)
    return (window,) * hf.num_hidden_layers


def _layer_ropes(hf: PretrainedConfig, head_dim: int) -> tuple[Rope, ...]:
    """One Rope per layer: shared, or per layer type when the config keys its rope parameters by type."""
    params = getattr(hf, "rope_parameters", None) or {}
    types = getattr(hf, "layer_types", None)
    if types is not None and set(types) <= set(params):
        by_type = {t: _rope(hf, head_dim, params[t], t) for t in set(types)}
        return tuple(by_type[t] for t in types)
    return (_rope(hf, head_dim, params, None),) * hf.num_hidden_layers


def _rope(hf: PretrainedConfig, head_dim: int, params: dict, layer_type: str | None) -> Rope:
    """Inverse frequencies through transformers' own rope functions, so every rope type matches HF."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return Rope(tuple(inv.tolist()), 1.0)
    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ValueError(f"unsupported rope type {rope_type!r}")
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu", **kwargs)
    return Rope(tuple(inv.tolist()), float(scaling))
