"""A tiny random-weight Llama with the default model's tokenizer: the `--quick` audit's subject.

Real text needs a real tokenizer, so the tiny model borrows the default one (and its vocabulary);
everything else is small enough for the whole audit to run in CI in a minute or two.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from splitllm.weights.sources import ModelFiles, cache_root


def tiny_model(folder: Path | None = None, layers: int = 4, width: int = 128, seed: int = 0) -> Path:
    """Build (once) and return an HF folder holding a random 4-layer, 128-wide Llama (wide enough that
    its 49,152 token embeddings stay distinguishable, as a real model's are)."""
    folder = folder or cache_root() / "models" / f"tiny-random-llama-{layers}-{width}-{seed}"
    if (folder / "config.json").is_file():
        return folder
    tokenizer = AutoTokenizer.from_pretrained(ModelFiles(None).path)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=folder.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(folder)
    except OSError:  # built meanwhile by another process: keep theirs
        shutil.rmtree(tmp)
    return folder
