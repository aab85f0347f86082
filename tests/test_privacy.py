"""Privacy audit: the quick audit end to end (tiny random model), white-box inversion and the
rotation defense on the default model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from splitllm.cli import app
from splitllm.client.pipeline import LocalMiddle, SplitPipeline
from splitllm.privacy import defenses
from splitllm.privacy.attacks.whitebox import LanguageModelPrior, invert
from splitllm.privacy.states import WIRE_DTYPE, PublicModel
from splitllm.model.weights import ModelFiles
from splitllm.visibility import Visibility


def _unfilled(value: object, path: str = "") -> list[str]:
    """Paths of report fields that are missing, None, NaN or empty."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _unfilled(v, f"{path}.{k}")] or ([] if value else [path])
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _unfilled(v, f"{path}[{i}]")] or ([] if value else [path])
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return [path]
    return []


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("privacy")
    result = CliRunner().invoke(app, ["privacy", "audit", "--quick", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads((out / "report.json").read_text()), out


def test_quick_audit_whitebox_inverts_an_undefended_one_layer_split(quick_report) -> None:  # type: ignore[no-untyped-def]
    report, _ = quick_report
    k1 = next(row for row in report["input_side"] if row["K"] == 1)
    assert k1["whitebox_recovery"] > 0.9
    assert k1["whitebox_positions"] >= 16


def test_quick_audit_fills_every_report_field(quick_report) -> None:  # type: ignore[no-untyped-def]
    report, out = quick_report
    assert _unfilled(report) == []
    assert [row["K"] for row in report["input_side"]] == [1, 2]
    assert [row["M"] for row in report["output_side"]] == [0, 1]
    fields = {
        "client_ms_per_step",
        "mlp_top1",
        "mlp_top5",
        "sequence_top1",
        "whitebox_recovery",
        "whitebox_seconds_per_token",
    }
    assert all(fields <= row.keys() for row in report["input_side"])
    assert all({"probe_top1", "whitebox_agreement"} <= row.keys() for row in report["output_side"])
    d = report["defenses"]
    assert {"noise", "rotation", "lowrank"} <= d.keys()
    assert all({"perplexity", "greedy_match", "whitebox_recovery", "mlp_top1"} <= row.keys() for row in d["noise"])
    assert report["corpus"]["train_positions"] >= 2048 and report["corpus"]["licence"]
    md = (out / "report.md").read_text()
    assert "## Input side" in md and "## Output side" in md and "Gaussian noise" in md
    assert (out / "leakage.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quick_audit_rotation_is_free_but_recoverable(quick_report) -> None:  # type: ignore[no-untyped-def]
    rot = quick_report[0]["defenses"]["rotation"]
    assert rot["greedy_match"] == 1.0
    assert rot["public_weights_whitebox_recovery"] < 0.5  # public weights alone no longer match...
    assert rot["key_error_from_server_weights"] < 1e-4  # ...but the server's own weights give the key away
    assert rot["recovered_key_whitebox_recovery"] > 0.9


@pytest.mark.slow
def test_whitebox_inverts_the_default_model_after_one_layer(default_files) -> None:  # type: ignore[no-untyped-def]
    """Left to right over a real sentence, proposals from the public LM only: exact matches."""
    from transformers import AutoTokenizer

    model = PublicModel(default_files, [1])
    ids = AutoTokenizer.from_pretrained(default_files.path)("The cat sat on the mat because it was warm.")["input_ids"]
    tokens = torch.tensor(ids)
    n = len(ids)
    caches = model.stack.new_caches(n)
    states = model.stack.forward(caches, model.embed[tokens], torch.arange(n), Visibility.chain(n), [])[1].to(
        WIRE_DTYPE
    )
    prior = LanguageModelPrior(model, n)

    def proposals(t: int, recovered: list[int]) -> list[torch.Tensor]:
        return [prior.extend(recovered[-1], t - 1) if t else -torch.arange(model.cfg.vocab_size, dtype=torch.float32)]

    inv = invert(model.stack.upto(1), model.embed, states, proposals)
    assert sum(a == b for a, b in zip(inv.tokens, ids)) / n >= 0.9


@pytest.mark.slow
def test_rotation_preserves_the_default_model_and_leaks_its_key(default_files, local_model, middle_stage) -> None:  # type: ignore[no-untyped-def]
    local, middle = local_model(None, 2, 2), middle_stage(None, 2, 2)
    q = defenses.random_rotation(default_files.config.hidden_size, seed=3)
    rotated_local, rotated_middle = defenses.rotate_local(local, q), defenses.rotate_stage(middle, q)
    tokens = torch.tensor([1, 504, 3458, 314, 260, 1345, 30, 198, 504, 2030, 314, 34, 30, 7, 21, 22])
    n = len(tokens)
    args = (tokens, torch.arange(n), Visibility.chain(n), [])
    plain = SplitPipeline(local, LocalMiddle(middle, n), n).score(*args)[0]
    secret = SplitPipeline(rotated_local, LocalMiddle(rotated_middle, n), n).score(*args)[0]
    assert (plain - secret).abs().max() < 1e-3
    assert torch.equal(plain.argmax(-1), secret.argmax(-1))
    recovered = defenses.rotation_from_weights(middle, rotated_middle)
    assert (recovered - q).norm() / q.norm() < 1e-4


def test_audit_states_of_a_gemma_are_the_splits_and_rotation_refuses_it(tiny_models, pipeline, random_ids) -> None:  # type: ignore[no-untyped-def]
    """The audit feeds scaled embeddings as the client does; the rotation defense needs Llama's norms only."""
    folder = tiny_models["gemma3"]
    model = PublicModel(ModelFiles(folder), [2])
    tokens = random_ids(12, seed=5)
    states = model.window_states(torch.tensor([tokens]), [2])
    split = pipeline(folder, 2, 1).score(torch.tensor(tokens), torch.arange(12), Visibility.chain(12), [])[0]
    assert torch.equal(states.greedy[0], split.argmax(-1))
    with pytest.raises(ValueError, match="rotation defense"):
        defenses.rotate_stage(model.local.head, defenses.random_rotation(model.cfg.hidden_size, seed=0))
