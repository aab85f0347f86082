"""Our decoder math against transformers: configs, full-model logits, sliding windows, splits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config

from splitllm.client.client_model import ClientModel
from splitllm.model.config import ModelConfig
from splitllm.model.stage import Stage, Step
from splitllm.weights.sources import ModelFiles
from splitllm.model.visibility import Visibility

ATOL = 1e-4


def _logits(pipeline, tokens: list[int]) -> torch.Tensor:
    n = len(tokens)
    logits, _ = pipeline.score(Step(torch.tensor(tokens), torch.arange(n), Visibility.chain(n)))
    return logits


def test_tiny_configs_are_read_as_their_architecture(tiny_models) -> None:
    llama, qwen2, mistral = (ModelFiles(tiny_models[n]).config for n in ("llama", "qwen2", "mistral"))
    assert (llama.qkv_bias, llama.tie_word_embeddings, llama.num_kv_heads) == (False, False, 2)
    assert (qwen2.qkv_bias, qwen2.tie_word_embeddings) == (True, True)
    assert llama.layer_windows == qwen2.layer_windows == (None,) * 4
    assert mistral.layer_windows == (8,) * 6


def test_tiny_gemma3_config_is_read_with_its_layer_kinds(tiny_models) -> None:
    cfg = ModelFiles(tiny_models["gemma3"]).config
    assert cfg.layer_windows == (8, None) * 3
    sliding, full = cfg.layer_ropes[:2]
    assert cfg.layer_ropes == (sliding, full) * 3 and sliding != full
    assert (cfg.norm_offset, cfg.qk_norm, cfg.sandwich_norm, cfg.hidden_act) == (1.0, True, True, "gelu_pytorch_tanh")
    assert (cfg.embed_scale, cfg.attn_scale, cfg.final_logit_softcap) == (8.0, 24**-0.5, 50.0)


@pytest.mark.slow
def test_default_config(default_files) -> None:
    cfg = default_files.config
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 576, 49152)
    assert cfg.tie_word_embeddings and not default_files.has("lm_head.weight")


def test_unsupported_architecture_is_refused() -> None:
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        ModelConfig.from_hf(GPT2Config())


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "gemma3"])
@pytest.mark.parametrize(("first", "last"), [(1, 1), (2, 0), (1, 2)])
def test_tiny_logits_match_transformers(name, first, last, tiny_models, pipeline, hf_model, random_ids) -> None:
    folder = tiny_models[name]
    tokens = random_ids(40, seed=7)  # five of the Mistral's and the Gemma's windows
    ours = _logits(pipeline(folder, first, last), tokens)
    with torch.no_grad():
        ref = hf_model(folder)(torch.tensor([tokens])).logits[0]
    assert (ours - ref).abs().max().item() < ATOL


def test_sliding_window_is_exercised(tiny_models, pipeline, hf_model, random_ids) -> None:
    """The tiny Mistral's window changes its logits, so matching transformers really tests the window."""
    folder = tiny_models["mistral"]
    window = ModelFiles(folder).config.layer_windows[0]
    tokens = random_ids(4 * window, seed=8)
    unwindowed = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, sliding_window=None).eval()
    with torch.no_grad():
        windowed = hf_model(folder)(torch.tensor([tokens])).logits[0]
        full = unwindowed(torch.tensor([tokens])).logits[0]
    assert (windowed[:window] - full[:window]).abs().max().item() < ATOL
    assert (windowed[window:] - full[window:]).abs().max().item() > 1e-2
    ours = _logits(pipeline(folder, 2, 2), tokens)
    assert (ours - windowed).abs().max().item() < ATOL


@pytest.mark.slow
@pytest.mark.parametrize(("first", "last"), [(2, 1), (1, 0)])
def test_default_logits_match_transformers(first, last, default_files, pipeline, hf_model) -> None:
    tokenizer = AutoTokenizer.from_pretrained(default_files.path)
    tokens = tokenizer("The quick brown fox jumps over the lazy dog because")["input_ids"]
    ours = _logits(pipeline(None, first, last), tokens)
    with torch.no_grad():
        ref = hf_model(None)(torch.tensor([tokens])).logits[0]
    assert (ours - ref).abs().max().item() < ATOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize(("first", "last"), [(0, 1), (1, -1), (2, 2), (3, 1), (4, 0)])
def test_invalid_splits_name_the_layer_count(first, last, tiny_models) -> None:
    files = ModelFiles(tiny_models["llama"])
    with pytest.raises(ValueError, match="the model has 4 layers"):
        ClientModel(files, first, last)


def test_stage_range_is_checked(tiny_models) -> None:
    cfg = ModelFiles(tiny_models["llama"]).config
    for start, end in [(-1, 2), (2, 2), (3, 5)]:
        with pytest.raises(ValueError, match="outside the model's 4 layers"):
            Stage(cfg, start, end, torch.float32)


@pytest.mark.slow
def test_client_reads_only_its_own_tensors(default_files, tensor_reads) -> None:
    """The client side maps embedding, norm, its first and last stages, and nothing of the middle."""
    read = tensor_reads
    ClientModel(ModelFiles(None), 2, 3)
    layers = {int(n.split(".")[2]) for n in read if n.startswith("model.layers.")}
    assert layers == {0, 1, 27, 28, 29}
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= set(read)
