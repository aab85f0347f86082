"""Fast by default: every side runs the fastest setting this machine runs well unless told otherwise,
the exact mode never compiles the CPU kernels, and a 16-bit setting without them says what it costs."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from splitllm.kernels import cpu_kernels
from splitllm.model import precision
from splitllm.model.precision import EXACT, Precision, fastest


def test_the_fastest_setting_follows_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    with_kernels = cpu_kernels.load() is not None
    assert fastest() == (Precision(torch.bfloat16, "mixed") if with_kernels else EXACT)
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)  # no kernel variant for this CPU, or no compiler
    assert fastest() == EXACT
    assert fastest("cuda") == Precision(device="cuda")  # unverified devices keep the exact mode


def test_a_server_runs_the_fastest_setting_unless_told() -> None:
    """`ServerSettings` takes `serve`'s default, so an embedded server and `splitllm serve` run alike."""
    from splitllm.server.settings import ServerSettings

    assert ServerSettings().precision == fastest()
    assert ServerSettings(dtype=torch.float32).precision == EXACT  # one given alone: the exact mode's other
    assert ServerSettings(dtype=torch.bfloat16).precision == Precision(torch.bfloat16)
    assert ServerSettings(quant="int8").precision == Precision(torch.float32, "int8")


def test_sixteen_bit_without_the_kernels_warns_once_that_speculation_is_not_bit_exact(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    precision._warn_without_kernels.cache_clear()
    with caplog.at_level(logging.WARNING, logger=precision.__name__):
        for _ in range(3):
            Precision(torch.bfloat16, "int8").attention(64)
        EXACT.attention(64)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "bfloat16-int8" in warnings[0] and "not bit-exact" in warnings[0]


@pytest.mark.slow  # a Python process of its own
def test_the_exact_mode_never_compiles_the_kernels(tiny_models, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A fresh process loads both sides in the exact mode and decodes, with an empty extension cache:
    the kernels are neither built nor imported."""
    code = f"""
import sys
from splitllm.client.client_model import ClientModel
from splitllm.client.pipeline import InProcessMiddle, SplitPipeline
from splitllm.decoding.sequential import decode_sequential
from splitllm.model.precision import EXACT
from splitllm.model.stage import Stage
from splitllm.weights.sources import ModelFiles
files = ModelFiles({str(tiny_models["mistral"])!r})
client_model = ClientModel(files, 1, 1, EXACT)
middle = Stage.load(files, 1, files.config.num_layers - 1, EXACT)
pipeline = SplitPipeline(client_model, InProcessMiddle(middle, 64), 64)
steps = list(decode_sequential(pipeline, [1, 2, 3, 4], 4, frozenset()))
print(len(steps), "splitllm_cpu_kernels" in sys.modules)
"""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["4", "False"]
    assert not (tmp_path / "extensions").exists()


@pytest.mark.slow
def test_the_exact_mode_drafts_without_compiling_the_kernels(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The default model with its shipped drafter in the exact mode: `auto` decodes sequentially there
    (PyTorch's kernels round a row by its step), nothing compiles the kernels, and the drafter follows the
    client's float32 instead of building bfloat16 stages that would need them."""
    code = """
import sys
from splitllm.client.client import SplitClient
from splitllm.model.precision import EXACT
client = SplitClient(None, precision=EXACT)
gen = client.generate("Name three colors.", 8, "auto")
print(client.client_model.drafter.dtype, len(gen.ids) > 0, "splitllm_cpu_kernels" in sys.modules)
"""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["torch.float32", "True", "False"]
    assert not (tmp_path / "extensions").exists()


@pytest.mark.slow
def test_serve_and_generate_with_exact_give_transformers_greedy_output(  # type: ignore[no-untyped-def]
    hf_greedy
) -> None:
    """The commands as a user runs them: `splitllm serve --exact` in its own process, `splitllm generate
    --exact --json` in another; the answer is transformers' greedy continuation, token for token."""
    from splitllm.testing.launch import ServerProcess

    prompt = "Name three prime numbers."
    with ServerProcess("--exact", "--threads", "1") as server:
        run = subprocess.run(
            [sys.executable, "-m", "splitllm.cli", "generate", prompt, "--server", server.url, "--exact",
             "--threads", "1", "--json", "--max-new-tokens", "16", "--wire-dtype", "float32", "--decode", "auto"],
            capture_output=True, text=True, timeout=600,
        )
    assert run.returncode == 0, run.stderr
    assert "client precision: float32-none (exact" in run.stderr
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    from transformers import AutoTokenizer

    from splitllm.weights.sources import ModelFiles

    tokenizer = AutoTokenizer.from_pretrained(ModelFiles(None).path)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert summary["prompt_tokens"] == len(ids)
    assert summary["ids"] == hf_greedy(None, ids, 16)[: len(summary["ids"])] and len(summary["ids"]) == 16
