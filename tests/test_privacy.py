"""Privacy audit: the quick audit end to end (tiny random model) and the checks it must pass, the
certified white-box search, the corpus's de-duplication, the docs generated from the committed report,
and white-box inversion and the rotation defense on the default model."""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from splitllm.cli import app
from splitllm.client.pipeline import InProcessMiddle, SplitPipeline
from splitllm.lab.privacy import defenses
from splitllm.lab.privacy.attacks.map_beam import fit, map_beam
from splitllm.lab.privacy.attacks.whitebox import LanguageModelPrior, invert
from splitllm.lab.privacy.checks import quick_checks
from splitllm.lab.rates import clopper_pearson
from splitllm.lab.privacy.published import DOCS, PUBLISHED, load, render_docs
from splitllm.lab.privacy.states import WIRE_DTYPE, PublicModel
from splitllm.weights.sources import ModelFiles
from splitllm.model.stage import Step
from splitllm.model.visibility import Visibility


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


@pytest.mark.slow  # the quick audit runs on the default model
def test_quick_audit_whitebox_inverts_and_certifies_an_undefended_split(  # type: ignore[no-untyped-def]
    quick_report
) -> None:
    report, _ = quick_report
    for row in report["input_side"]:
        assert row["whitebox_recovery"]["rate"] > 0.9 and row["whitebox_certified"]["rate"] > 0.9
        assert row["whitebox_recovery"]["n"] >= 64  # whole windows
        assert row["whitebox_collisions"] == 0 and row["whitebox_exhaustive_positions"] >= 1


@pytest.mark.slow  # the quick audit
def test_quick_audit_fills_every_report_field(quick_report) -> None:  # type: ignore[no-untyped-def]
    report, out = quick_report
    assert _unfilled(report) == [".checks"]  # empty: every check passed
    assert [row["K"] for row in report["input_side"]] == [1, 2]
    assert [row["M"] for row in report["output_side"]] == [0, 1]
    fields = {"client_ms_per_step", "mlp_top1", "mlp_top5", "sequence_top1", "whitebox_recovery", "whitebox_by_kind"}
    assert all(fields <= row.keys() for row in report["input_side"])
    lo, hi = report["input_side"][0]["mlp_top1"]["ci95"]
    assert lo < report["input_side"][0]["mlp_top1"]["rate"] < hi
    assert set(report["input_side"][0]["mlp_top1_by_kind"]) == {"prose", "code", "chat", "personal"}
    assert all({"probe_top1", "whitebox_agreement"} <= row.keys() for row in report["output_side"])
    assert [row["temperature"] for row in report["output_sampling"]] == [0.7, 1.0]
    d = report["defenses"]
    assert {"noise", "dp_noise", "rotation", "lowrank"} <= d.keys()
    cost = {"perplexity", "kl_nats", "top1_agreement", "whitebox_recovery", "mlp_top1", "map_likelihood", "map_beam"}
    assert all(cost <= row.keys() for row in d["noise"] + d["dp_noise"])
    p = report["provenance"]
    assert len(p["git_commit"]) == 40 and len(p["model_fingerprint"]) == 64 and p["libraries"]["torch"]
    assert set(p["corpus_sha256"]) == {"train", "test", "long"}
    assert report["corpus"]["dedup"]["ngram"] == 13
    md = (out / "report.md").read_text()
    assert "### Input side" in md and "### Output side" in md and "Gaussian noise" in md
    assert (out / "leakage.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # the quick audit
def test_quick_audit_rotation_is_free_but_recoverable(quick_report) -> None:  # type: ignore[no-untyped-def]
    rot = quick_report[0]["defenses"]["rotation"]
    assert rot["top1_agreement"]["rate"] == 1.0 and rot["kl_nats"] < 1e-4
    assert rot["public_weights_whitebox_recovery"]["rate"] < 0.5  # public weights alone no longer match...
    assert rot["key_error_from_server_weights"] < 1e-4  # ...but the server's own weights give the key away
    assert rot["recovered_key_whitebox_recovery"]["rate"] > 0.9


def _broken(report: dict, path: tuple, value: dict) -> dict:
    out = copy.deepcopy(report)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


@pytest.mark.slow  # the quick audit
def test_quick_checks_fail_on_broken_or_peeking_attacks(quick_report) -> None:  # type: ignore[no-untyped-def]
    report, _ = quick_report
    assert quick_checks(report) == []

    def at(base: float) -> dict:  # what an attack that learned nothing scores: its baseline
        return {"rate": base, "hits": round(512 * base), "n": 512, "ci95": [0.8 * base, min(1.0, 1.2 * base)]}

    baselines = report["baselines"]
    perfect = {"rate": 1.0, "hits": 8, "n": 8, "ci95": [0.631, 1.0]}
    broken = _broken(report, ("input_side", 0, "mlp_top1"), at(baselines["input"]["most_frequent_top1"]))
    assert any("learned attack" in f for f in quick_checks(broken))
    broken = _broken(report, ("output_side", 1, "probe_top1"), at(baselines["output"]["most_frequent_top1"]))
    assert any("output probe" in f for f in quick_checks(broken))
    peeking = _broken(report, ("defenses", "rotation", "public_weights_whitebox_recovery"), perfect)
    assert any("negative control" in f for f in quick_checks(peeking))


def test_clopper_pearson_matches_known_bounds() -> None:
    lo, hi = clopper_pearson(64, 64)
    assert hi == 1.0 and abs(lo - 0.9440) < 1e-3  # 64/64 supports only >= 94.4% at 95%
    lo, hi = clopper_pearson(50, 100)
    assert abs(lo - 0.3983) < 1e-3 and abs(hi - 0.6017) < 1e-3


def test_docs_tables_match_the_committed_report() -> None:
    """docs/privacy.md carries the tables `splitllm privacy docs` generates from the committed
    report; editing them by hand, or committing a new report without regenerating, fails."""
    root = Path(__file__).resolve().parents[1]
    report = load(root / PUBLISHED / "report.json")
    for name in DOCS:
        text = (root / name).read_text()
        assert "<!-- privacy-audit:" in text
        assert render_docs(report,
                           text) == text, f"{name} drifted from {PUBLISHED}/report.json: run `splitllm privacy docs`"


@pytest.mark.slow
def test_corpus_test_windows_share_no_ngram_or_person_with_training(  # type: ignore[no-untyped-def]
    default_files
) -> None:
    from transformers import AutoTokenizer

    from splitllm.lab.data import synthetic
    from splitllm.lab.data.corpus import NGRAM, build_corpus, documents

    tokenizer = AutoTokenizer.from_pretrained(default_files.path)
    corpus = build_corpus(tokenizer, 128, 2048, 3072)
    train_docs = [d for d in documents(tokenizer) if not d.test]
    seen = set()
    for ids in tokenizer([d.text for d in train_docs], add_special_tokens=False)["input_ids"]:
        seen |= {tuple(ids[i : i + NGRAM]) for i in range(len(ids) - NGRAM + 1)}
    for window in corpus.test.tolist():
        assert not any(tuple(window[i : i + NGRAM]) in seen for i in range(len(window) - NGRAM + 1))
    assert set(corpus.test_kinds) == {"prose", "code", "chat", "personal"}
    assert corpus.describe()["dedup"]["test_windows_dropped"] > 0  # help topics quote each other
    generated = " ".join(d.text for d in train_docs if d.kind in ("chat", "personal"))
    assert not any(re.search(rf"\b{name}\b", generated) for name in synthetic.FIRST[1::2])  # the test side's names


def test_certified_search_falls_back_to_the_whole_vocabulary(tiny_models) -> None:  # type: ignore[no-untyped-def]
    """Proposals that rank the true token last, a tiny cap: the certified search still finds every
    token, certifies each match, and the whole-vocabulary check finds no collision."""
    from splitllm.weights.sources import ModelFiles

    files = ModelFiles(tiny_models["llama"])
    model = PublicModel(files, [1])
    vocab = files.config.vocab_size
    tokens = torch.tensor([5, 17, 3, 99, 42, 7])
    n = len(tokens)
    states = model.stack.forward(model.stack.new_caches(n), model.embed[tokens], torch.arange(n), Visibility.chain(n),
                                 [])
    targets = states[1].to(WIRE_DTYPE)

    def misleading(t: int, recovered: list[int]) -> list[torch.Tensor]:
        scores = torch.arange(vocab, dtype=torch.float32)
        scores[tokens[t]] = -1.0  # the true token is proposed last
        return [scores]

    inv = invert(model.stack.upto(1), model.embed, targets, misleading, max_candidates=8, exhaustive={0, 3})
    assert inv.tokens == tokens.tolist()
    assert all(inv.certified) and inv.candidates[1] == vocab
    assert inv.exhaustive == [True, False, False, True, False, False] and sum(inv.collisions) == 0
    capped = invert(model.stack.upto(1), model.embed, targets, misleading, max_candidates=8, certify=False)
    assert capped.candidates[1] == 8 and not capped.certified[1]


def test_noise_likelihood_is_the_density_the_defense_draws_from() -> None:
    """Relative noise: std sigma x the clean state's RMS; DP: clipped to the norm bound, then a fixed
    std. The draws follow that model, the attack's log likelihood is its Gaussian density, and only
    the clean state that was sent fits the draw."""
    gen = torch.Generator().manual_seed(0)
    clean = torch.randn(3, 256, generator=gen) * torch.tensor([[1.0], [3.0], [10.0]])
    rms = clean.pow(2).mean(-1, keepdim=True).sqrt()
    clipped = clean * (20.0 / clean.norm(dim=-1, keepdim=True)).clamp(max=1.0)
    dp = defenses.DPNoise(clip=20.0, epsilon=200.0)
    for noise, mean, std in ((defenses.RelativeNoise(0.5), clean, 0.5 * rms),
                             (dp, clipped, torch.full((3, 1), dp.sigma))):
        sent = noise(clean, gen)
        z = (sent - mean) / std
        assert abs(float(z.mean())) < 0.15 and abs(float(z.std()) - 1) < 0.1  # 4 standard errors
        for i in range(3):
            f = fit(noise, sent[i], clean)
            density = torch.distributions.Normal(mean[i], std[i]).log_prob(sent[i]).sum()
            assert torch.isclose(f.log_likelihood[i], density, rtol=1e-5)
            assert f.fits.tolist() == [j == i for j in range(3)]


def _states_after(model: PublicModel, cut: int, tokens: torch.Tensor) -> torch.Tensor:
    n = len(tokens)
    caches = model.stack.new_caches(n)
    return model.stack.forward(caches, model.embed[tokens], torch.arange(n), Visibility.chain(n),
                               [])[cut].to(WIRE_DTYPE)


def test_map_beam_recovers_what_was_sent_not_what_was_proposed(tiny_models) -> None:  # type: ignore[no-untyped-def]
    """Proposals rank sequence a first and sequence b second at every position. From b's states,
    clean or under noise of 0.3 x their RMS, the MAP attack recovers b and none of a: an attack that
    followed its proposals or peeked at a would fail. A true token ranked past the first chunk is
    still found (no candidate fits before it), and not when the cap stops the search short of it."""
    model = PublicModel(ModelFiles(tiny_models["llama"]), [1])
    vocab = model.cfg.vocab_size
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, vocab, (2, 10), generator=gen)
    learned = torch.randn(10, vocab, generator=gen)
    learned[torch.arange(10), a], learned[torch.arange(10), b] = 100.0, 99.0
    for noise in (defenses.RelativeNoise(0.0), defenses.RelativeNoise(0.3)):
        sent = noise(_states_after(model, 1, b), gen)
        for beam, prior in ((1, False), (3, True)):
            out = map_beam(model, 1, sent, noise, learned, beam, prior, max_candidates=64, smallest=8)
            assert out.tokens == b.tolist()
            assert not any(x == y for x, y in zip(out.tokens, a.tolist()))
    # Heavy noise: several hypotheses survive and share parents; the winner's score is its log
    # likelihood and log prior recomputed from scratch over its own tokens.
    noise = defenses.RelativeNoise(3.0)
    sent = noise(_states_after(model, 1, b), gen)
    out = map_beam(model, 1, sent, noise, learned, 4, True, max_candidates=64, smallest=8)
    tokens = torch.tensor(out.tokens)
    states = model.stack.forward(model.stack.new_caches(10), model.embed[tokens], torch.arange(10),
                                 Visibility.chain(10), [])
    log_prior = torch.log_softmax(model.logits(states[model.cfg.num_layers]).float(), -1)[:-1].gather(-1,
                                                                                                      tokens[1:, None])
    likelihood = sum(fit(noise, sent[t], states[1][t : t + 1]).log_likelihood for t in range(10))
    assert math.isclose(out.score, float(likelihood + log_prior.sum()), rel_tol=1e-4)
    # The first position has no prior: its order is the learned one alone, where b[0] ranks 100th.
    far = -torch.arange(vocab, dtype=torch.float32)[None]
    far[0, b[0]] = -99.5 - int(b[0] < 100)
    sent, clean = _states_after(model, 1, b[:1]), defenses.RelativeNoise(0.0)
    found = map_beam(model, 1, sent, clean, far, 1, False, max_candidates=256, smallest=8)
    assert found.tokens == b[:1].tolist() and found.candidates == 8 + 16 + 32 + 64  # the fourth chunk holds it
    assert map_beam(model, 1, sent, clean, far, 1, False, max_candidates=64, smallest=8).tokens != b[:1].tolist()


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
def test_map_beam_reads_a_chat_message_through_noise_on_the_default_model(  # type: ignore[no-untyped-def]
    default_files
) -> None:
    """K = 2, noise of 0.3 x the state's RMS, proposals from the public LM only (the learned ranking
    is replaced by token id order): the user's message comes back word for word."""
    from transformers import AutoTokenizer

    model = PublicModel(default_files, [2])
    tokenizer = AutoTokenizer.from_pretrained(default_files.path)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "My name is Alice and I live in Paris."}])
    ids = chat if isinstance(chat, list) else chat["input_ids"]
    noise = defenses.RelativeNoise(0.3)
    sent = noise(_states_after(model, 2, torch.tensor(ids)), torch.Generator().manual_seed(0))
    by_id = -torch.arange(model.cfg.vocab_size, dtype=torch.float32).expand(len(ids), -1)
    out = map_beam(model, 2, sent, noise, by_id, beam=2)
    message = len(ids) - 15  # <|im_start|>user\nMy name is Alice and I live in Paris.<|im_end|>\n
    assert tokenizer.decode(out.tokens[message:]) == tokenizer.decode(ids[message:])
    assert sum(a == b for a, b in zip(out.tokens, ids)) >= 0.75 * len(ids)


@pytest.mark.slow
def test_rotation_preserves_the_default_model_and_leaks_its_key(  # type: ignore[no-untyped-def]
    default_files, load_client_model, middle_stage
) -> None:
    client_model, middle = load_client_model(None, 2, 2), middle_stage(None, 2, 2)
    q = defenses.random_rotation(default_files.config.hidden_size, seed=3)
    rotated_client_model, rotated_middle = defenses.rotate_client_model(client_model, q), defenses.rotate_stage(middle,
                                                                                                                q)
    tokens = torch.tensor([1, 504, 3458, 314, 260, 1345, 30, 198, 504, 2030, 314, 34, 30, 7, 21, 22])
    n = len(tokens)
    step = Step(tokens, torch.arange(n), Visibility.chain(n))
    plain = SplitPipeline(client_model, InProcessMiddle(middle, n), n).score(step)[0]
    secret = SplitPipeline(rotated_client_model, InProcessMiddle(rotated_middle, n), n).score(step)[0]
    assert (plain - secret).abs().max() < 1e-3
    assert torch.equal(plain.argmax(-1), secret.argmax(-1))
    recovered = defenses.rotation_from_weights(middle, rotated_middle)
    assert (recovered - q).norm() / q.norm() < 1e-4


def test_audit_states_of_a_gemma_are_the_splits_and_rotation_refuses_it(  # type: ignore[no-untyped-def]
    tiny_models, pipeline, random_ids
) -> None:
    """The audit feeds scaled embeddings as the client does; the rotation defense needs Llama's norms only."""
    folder = tiny_models["gemma3"]
    model = PublicModel(ModelFiles(folder), [2])
    tokens = random_ids(12, seed=5)
    states = model.window_states(torch.tensor([tokens]), [2])
    split = pipeline(folder, 2, 1).score(Step(torch.tensor(tokens), torch.arange(12), Visibility.chain(12)))[0]
    assert torch.equal(states.greedy[0], split.argmax(-1))
    with pytest.raises(ValueError, match="rotation defense"):
        defenses.rotate_stage(model.client_model.first, defenses.random_rotation(model.cfg.hidden_size, seed=0))
