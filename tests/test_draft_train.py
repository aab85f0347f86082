"""Drafter training and storage: the unrolled training passes equal chained drafting, a tiny model's
drafter trains and round-trips through its folder, foreign drafters are refused, the shipped drafter drafts."""

from __future__ import annotations

import json
import logging
import random

import pytest
import torch
import typer

from splitllm.client.client_model import ClientModel
from splitllm.drafting import store
from splitllm.lab.data import instructions
from splitllm.lab.training import data, train
from splitllm.lab.training.capture import FeatureCapture
from splitllm.model.stage import Stage, Step
from splitllm.weights.sources import ModelFiles
from splitllm.model.visibility import Visibility


def _features(files: ModelFiles, seqs: list[list[int]]) -> data.Features:
    feats = FeatureCapture(files, torch.float32).features(seqs)
    return data.Features([torch.tensor(s) for s in seqs], [f.float() for f in feats])


def _sequences(files: ModelFiles, n: int, length: int, seed: int) -> data.Features:
    rng = random.Random(seed)
    return _features(files, [[rng.randrange(files.config.vocab_size) for _ in range(length - i)] for i in range(n)])


def _own_features(files: ModelFiles, ids: list[int]) -> torch.Tensor:
    """The split client's view: splitllm's decoder over every layer, float32."""
    stage = Stage.load(files, 0, files.config.num_layers, torch.float32)
    n = len(ids)
    x = ClientModel(files, 1, 0).embed(torch.tensor(ids))
    return stage(stage.new_cache(n), Step(x, torch.arange(n), Visibility.chain(n)))


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen2"])
def test_captured_answers_are_the_references_and_features_the_clients_own(tiny_models, hf_model, family) -> None:
    """Answers and features come from one batched pass over prompts of different lengths: each answer is
    transformers' greedy one, each position's feature what splitllm's decoder computes there alone."""
    files = ModelFiles(tiny_models[family])
    capture = FeatureCapture(files, torch.float32)
    prompts = [[5, 9, 13, 2, 7, 30, 11], [8, 3], [21, 4, 6, 17]]
    answers = capture.answer(prompts, max_new_tokens=6)
    reference = hf_model(files.path)
    for prompt, (ids, feats) in zip(prompts, answers):
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)[0]
        assert ids == want.tolist()
        assert feats.shape == (len(ids), files.config.hidden_size)
        torch.testing.assert_close(feats.float(), _own_features(files, ids), rtol=2e-3, atol=2e-2)
    for (_ids, feats), again in zip(answers, capture.features([ids for ids, _ in answers])):
        torch.testing.assert_close(again.float(), feats.float(), rtol=2e-3, atol=2e-2)


def test_an_answer_ends_at_its_stop_token_with_the_token_fed(tiny_models) -> None:
    files = ModelFiles(tiny_models["llama"])
    (ids, _), = FeatureCapture(files, torch.float32).answer([[5, 9, 13]], max_new_tokens=6)
    stop = ids[4]  # the second answered token
    (short, feats), = FeatureCapture(files, torch.float32, stop=[stop]).answer([[5, 9, 13]], max_new_tokens=6)
    assert short == ids[: ids.index(stop) + 1] and feats.shape[0] == len(short)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def trainee(tiny_models, request):
    """A tiny model with its training sequences; Gemma 3 adds scaled embeddings, sandwich norms, soft-capping."""
    files = ModelFiles(tiny_models[request.param])
    client_model = ClientModel(files, 1, 0)
    target = train.Target(client_model)
    seqs = train.prepare(_sequences(files, 6, 24, 0), target)
    return files, client_model, target, seqs


def test_unrolled_passes_equal_chained_drafting(trainee) -> None:
    """Pass k's row b+k is what the drafter computes drafting k+1 deep from committed position b."""
    files, client_model, target, seqs = trainee
    torch.manual_seed(0)
    drafter = train.new_drafter(client_model, list(range(files.config.vocab_size)))
    s = seqs[0]
    passes = 3
    with torch.no_grad():
        outs = train.unrolled(drafter, target, [s], passes, greedy=True)
    b = 9
    cache = drafter.new_cache(64)
    emb = target.embed
    got = drafter(cache, s.feats[: b + 1], emb[s.ids[1 : b + 2]], torch.arange(b + 1), Visibility.chain(b + 1), [])[-1]
    torch.testing.assert_close(got, outs[0][b], rtol=1e-4, atol=1e-4)
    keep = list(range(b + 1))
    for k in range(1, passes):
        pos = b + k
        got = drafter(cache, got[None], emb[s.greedy[pos : pos + 1]], torch.tensor([pos]), Visibility.chain(1), keep)[0]
        torch.testing.assert_close(got, outs[k][pos], rtol=1e-4, atol=1e-4)
        keep = [0]


def test_tiny_drafter_trains_and_round_trips(trainee, tmp_path) -> None:
    files, client_model, target, seqs = trainee
    vocab = train.draft_vocabulary(seqs[1:], 128, files.config.vocab_size)
    assert len(vocab) == 128 and len(set(vocab)) == 128
    drafter = train.new_drafter(client_model, vocab)
    settings = train.TrainSettings(vocab=128, epochs=3, passes=2, batch_tokens=64, lr=3e-3)
    history = train.train(drafter, target, seqs[1:], settings)
    assert history["steps"] >= 3 and history["last_loss"] < history["first_loss"]
    val = train.validate(drafter, target, seqs[:1], depth=3)
    assert len(val.acceptance) == 3 and val.positions > 0
    shares = [val.in_top[k] for k in train.RANKS]
    assert shares == sorted(shares) and 0 <= val.outside_vocab <= 1 - shares[-1]
    folder = store.save_drafter(drafter, tmp_path / "drafter",
                                {store.FINGERPRINT_KEY: files.fingerprint, "model": "tiny"})
    meta = json.loads((folder / store.METADATA).read_text())
    assert meta["draft_vocab"] == 128 and meta["size_bytes"] > 0
    loaded = store.load_drafter(files, folder)
    assert loaded is not None and loaded.vocab.tolist() == vocab
    x = seqs[0]
    args = (x.feats[:5], client_model.embed(x.ids[1:6]), torch.arange(5), Visibility.chain(5), [])
    torch.testing.assert_close(loaded(loaded.new_cache(8), *args), drafter(drafter.new_cache(8), *args), rtol=2e-2,
                               atol=2e-2)


def test_a_zero_feature_weight_scores_tokens_alone(trainee) -> None:
    """With feature_weight 0 (EAGLE-3's loss) the loss no longer depends on how close the guessed
    features are, only on the draft distribution they give; with 1 it does."""
    files, client_model, target, seqs = trainee
    drafter = train.new_drafter(client_model, train.draft_vocabulary(seqs, 64, files.config.vocab_size))
    batch, rows = seqs[:2], target.lm_head[drafter.vocab]
    feats, probs = train._labels(batch, target, rows)
    with torch.no_grad():
        outs = train.unrolled(drafter, target, batch, 2)
    moved = feats + 0.5 * feats.std()  # other feature labels, the same token labels
    for weight, same in ((0.0, True), (1.0, False)):
        settings = train.TrainSettings(vocab=64, passes=2, feature_weight=weight)
        loss = [float(train._loss(outs, batch, f, probs, target, rows, 1.0, settings)) for f in (feats, moved)]
        assert (loss[0] == loss[1]) == same, weight


def test_taps_come_beside_the_top_feature(tiny_models) -> None:
    """A tapped capture runs the stack cut at its taps: the top features are the untapped capture's bits,
    and the tap the output of the layers below it run alone."""
    files = ModelFiles(tiny_models["llama"])
    d = files.config.hidden_size
    seqs = [[5, 9, 13, 2, 7], [8, 3, 4]]
    plain = FeatureCapture(files, torch.float32).features(seqs)
    tapped = FeatureCapture(files, torch.float32, taps=(1, 3)).features(seqs)
    below = Stage.load(files, 0, 1, torch.float32)
    for ids, p, t in zip(seqs, plain, tapped):
        assert t.shape == (len(ids), 3 * d) and torch.equal(t[:, -d:], p)
        x = ClientModel(files, 1, 0).embed(torch.tensor(ids))
        want = below(below.new_cache(len(ids)), Step(x, torch.arange(len(ids)), Visibility.chain(len(ids))))
        torch.testing.assert_close(t[:, :d].float(), want, rtol=2e-3, atol=2e-3)  # float32 rounds by batch
    (ids, feats), = FeatureCapture(files, torch.float32, taps=(1, 3)).answer([[5, 9, 13]], max_new_tokens=4)
    (same, top), = FeatureCapture(files, torch.float32).answer([[5, 9, 13]], max_new_tokens=4)
    assert ids == same and torch.equal(feats[:, -d:], top)
    with pytest.raises(ValueError, match="taps must be increasing"):
        FeatureCapture(files, torch.float32, taps=(3, 1))


def test_a_tapped_drafter_continues_a_plain_one_and_drafts_as_it_trained(trainee, tmp_path, monkeypatch,
                                                                         caplog) -> None:
    """Continued from a plain drafter, a tapped drafter first computes what that drafter did (its `fuse` passes
    the top feature); trained on tapped data it learns, round-trips with its taps, drafts through its
    cache what training computed, and a split that does not hold its taps refuses it."""
    files, client_model, target, _ = trainee
    n = files.config.num_layers
    feats = _sequences(files, 6, 24, 0)
    tapped = FeatureCapture(files, torch.float32, taps=(1, n - 1)).features([x.tolist() for x in feats.ids])
    seqs = train.prepare(data.Features(feats.ids, tapped, (1, n - 1)), target)
    settings = train.TrainSettings(vocab=64, epochs=2, passes=2, batch_tokens=64, lr=3e-3)
    plain = train.new_drafter(client_model, train.draft_vocabulary(seqs, 64, files.config.vocab_size))
    train.train(plain, target, seqs[1:], settings)
    meta = {store.FINGERPRINT_KEY: files.fingerprint, "model": "tiny"}
    start = store.load_drafter(files, store.save_drafter(plain, tmp_path / "untapped", meta), packed=False)
    with_taps = train.new_drafter(client_model, [], taps=(1, n - 1), init=start)
    with torch.no_grad():
        for a, b in zip(train.unrolled(with_taps, target, seqs[:2], 2), train.unrolled(start, target, seqs[:2], 2)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    history = train.train(with_taps, target, seqs[1:], settings)
    assert history["last_loss"] < history["first_loss"]
    folder = store.save_drafter(with_taps, tmp_path / "tapped", meta)
    assert json.loads((folder / store.METADATA).read_text())["taps"] == [1, n - 1]
    loaded = store.load_drafter(files, folder)
    assert loaded is not None and loaded.taps == (1, n - 1)
    # not where the package's drafters are
    broken = store.save_drafter(with_taps, tmp_path / "elsewhere" / "broken", meta)
    (broken / store.METADATA).write_text(json.dumps({**json.loads((broken / store.METADATA).read_text()),
                                                     "taps": [n - 1, 1]}))
    with pytest.raises(ValueError, match="drafter.json: taps must be increasing"):
        store.load_drafter(files, broken)
    s = seqs[0]
    with torch.no_grad():
        want = train.unrolled(loaded, target, [s], 1)[0]
    got = loaded(loaded.new_cache(32), s.feats[:-1], target.embed[s.ids[1:]], torch.arange(len(s.ids) - 1),
                 Visibility.chain(len(s.ids) - 1), [], s.taps[:-1])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="does not hold"):
        ClientModel(files, 2, 1, drafter=folder)
    assert ClientModel(files, 1, 1, drafter=folder).drafter.taps == (1, n - 1)
    monkeypatch.setattr(store, "shipped_drafters_root", lambda: tmp_path)  # as if the package shipped it
    assert ClientModel(files, 1, 1).drafter.taps == (1, n - 1)
    with caplog.at_level(logging.WARNING):
        assert ClientModel(files, 2, 1).drafter is None
    assert "does not hold" in caplog.text


def test_foreign_or_broken_drafters_are_refused(trainee, tiny_models, tmp_path) -> None:
    files, client_model, _, _ = trainee
    drafter = train.new_drafter(client_model, list(range(16)))
    folder = store.save_drafter(drafter, tmp_path / "foreign", {store.FINGERPRINT_KEY: "0" * 64, "model": "other"})
    with pytest.raises(ValueError, match="trained for another model"):
        store.load_drafter(files, folder)
    other = ModelFiles(tiny_models["qwen2"])
    stamped = store.save_drafter(drafter, tmp_path / "shape", {store.FINGERPRINT_KEY: other.fingerprint})
    with pytest.raises(ValueError, match="does not fit"):
        store.load_drafter(other, stamped)
    with pytest.raises(ValueError, match="no drafter.json"):
        store.load_drafter(files, tmp_path)
    assert store.load_drafter(files) is None  # nothing shipped for a random model


def test_overlap_check_drops_sequences_sharing_an_ngram() -> None:
    evaluation = {"prompts": [list(range(100, 120))]}
    clean = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    leaky = [1, 2, *range(105, 113), 3]
    kept, report = data.drop_overlapping([clean, leaky, [*range(100, 107), 1]], evaluation, n=8)
    assert kept == [clean, [*range(100, 107), 1]]
    assert report["sequences_dropped"] == 1 and report["longest_shared_ngram_after_drop"] == {"prompts": 7}


@pytest.mark.slow
def test_prompts_share_no_ngram_with_the_benchmarks(default_files) -> None:
    from splitllm.lab.data.workload import DEMO_PROMPT, workload

    tok = data.load_tokenizer(default_files)
    ids = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    evaluation = [ids(p.text) for p in workload()] + [ids(DEMO_PROMPT)]
    turns = [t for c in instructions.build(1024, follow_up_share=1.0) for t in c.turns]
    assert data.longest_shared([ids(t) for t in turns], evaluation) < data.EVAL_NGRAM


def test_held_out_pools_are_unseen_and_name_no_benchmark_subject() -> None:
    """Held-out conversations draw only from pools training never uses, and no pool names what the
    benchmark workload or the demo asks about."""
    from splitllm.lab.data.workload import DEMO_PROMPT, workload

    training, held = instructions.TRAINING, instructions.HELD_OUT
    for name in ("subjects", "tasks", "activities", "concepts"):
        assert not set(getattr(training, name)) & set(getattr(held, name)), name
    first_turns = {c.turns[0] for c in instructions.build(3000)}
    held_out = instructions.held_out(32)
    assert all(len(v) == 32 for v in held_out.values())
    assert not first_turns & {c.turns[0] for v in held_out.values() for c in v}
    benchmark = " ".join([p.text.lower() for p in workload()] + [DEMO_PROMPT.lower()])
    for word in ("palindrome", "black hole", "purr", "camping", "houseplant", "planet", "lighthouse", "dragon",
                 "ocean", "autumn", "robot", "mars", "tea", "flat tire", "binary search", "weather"):
        assert word in benchmark  # the list names the workload's subjects
        for pool in (training, held):
            assert not any(word in x.lower().split() or f" {word} " in f" {x.lower()} "
                           for x in [*pool.subjects, *pool.tasks, *pool.activities]), word


def test_conversations_cycle_through_kinds_and_follow_ups() -> None:
    made = instructions.build(600, follow_up_share=0.5)
    assert len({c.turns[0] for c in made}) == 600
    summary = instructions.describe(made)
    assert summary["by_kind"]["code"] > 100 and summary["by_kind"]["conversation"] > 300
    assert 200 < summary["with_follow_up"] < 400
    assert all(c.turns[1] in instructions.FOLLOW_UPS[c.kind] or c.kind == "code" for c in made if len(c.turns) > 1)
    with pytest.raises(ValueError, match="distinct prompts"):
        instructions.build(10**6, tries=2)
    with pytest.raises(ValueError, match="share"):
        instructions.build(4, follow_up_share=1.5)


@pytest.mark.slow
def test_shipped_drafter_drafts_well_above_chance(default_files) -> None:
    """On held-out Language Reference prose (documents no drafter ever trains on), depth 1 hits often."""
    drafter = store.load_drafter(default_files)
    assert drafter is not None, "the default model ships a drafter"
    tok = data.load_tokenizer(default_files)
    docs = [d for d in data.corpus.reference_documents() if d.test and d.kind == "prose"][:3]
    seqs = [data.chat_ids(tok,
                          [data.turn("user", "Tell me about Python."),
                           data.turn("assistant", d.text[:600])]) for d in docs]
    target = train.Target(ClientModel(default_files, 1, 0))
    val = train.validate(drafter, target, train.prepare(_features(default_files, seqs), target), depth=2)
    assert val.positions > 200
    assert val.acceptance[0] > 0.2  # chance is about 1 / len(vocab)
    assert val.in_top[1] == pytest.approx(val.acceptance[0], abs=0.05)  # every position, not only chains' bases
    assert val.in_top[10] > val.in_top[1] and val.outside_vocab < 0.2


def test_a_narrower_drafter_keeps_its_strongest_channels_and_stores_int8(trainee, tmp_path) -> None:
    files, client_model, target, seqs = trainee
    full = train.new_drafter(client_model, list(range(64)))
    narrow = train.new_drafter(client_model, list(range(64)), intermediate=files.config.intermediate_size // 2)
    assert narrow.cfg.intermediate_size == files.config.intermediate_size // 2
    down_full, down = full.stage.layers[0].down.weight, narrow.stage.layers[0].down.weight
    kept = [int((down_full.T == col).all(-1).nonzero()) for col in down.T]  # every kept column is one of the layer's
    assert kept == sorted(kept)
    meta = {store.FINGERPRINT_KEY: files.fingerprint}
    small = store.save_drafter(narrow, tmp_path / "int8", meta, weights="int8")
    half = store.save_drafter(narrow, tmp_path / "half", meta)
    assert (small / store.WEIGHTS).stat().st_size < 0.7 * (half / store.WEIGHTS).stat().st_size
    loaded = store.load_drafter(files, small)
    x = seqs[0]
    args = (x.feats[:5], client_model.embed(x.ids[1:6]), torch.arange(5), Visibility.chain(5), [])
    got, want = loaded(loaded.new_cache(8), *args), narrow(narrow.new_cache(8), *args)
    assert float((got - want).norm() / want.norm()) < 0.02  # int8 per-row rounding, relative to the output
    drafting = store.load_drafter(files, small, torch.bfloat16)  # drafts with int8 weights, as stored
    fast = drafting(drafting.new_cache(8), *args).float()
    assert float((fast - want).norm() / want.norm()) < 0.05
    with pytest.raises(ValueError, match="stored as one of"):
        store.save_drafter(narrow, tmp_path / "bad", meta, weights="int3")


def test_a_wider_drafter_starts_as_the_last_layer_and_round_trips(trainee, tmp_path) -> None:
    files, client_model, target, seqs = trainee
    torch.manual_seed(0)  # fc's embedding half starts random
    full = train.new_drafter(client_model, list(range(64)))
    width = files.config.intermediate_size * 3
    torch.manual_seed(0)
    wide = train.new_drafter(client_model, list(range(64)), intermediate=width)
    assert wide.cfg.intermediate_size == width
    x = seqs[0]
    args = (x.feats[:5], client_model.embed(x.ids[1:6]), torch.arange(5), Visibility.chain(5), [])
    want = full(full.new_cache(8), *args)
    torch.testing.assert_close(wide(wide.new_cache(8), *args), want)  # the added channels add nothing yet
    train.train(wide, target, seqs, train.TrainSettings(epochs=1, passes=2, batch_tokens=256, bfloat16=False))
    assert float(wide.stage.layers[0].down.weight[:, files.config.intermediate_size :].abs().max()) > 0  # they learn
    saved = store.save_drafter(wide, tmp_path / "wide", {store.FINGERPRINT_KEY: files.fingerprint})
    assert store.read_metadata(saved)["intermediate_size"] == width
    loaded = store.load_drafter(files, saved, packed=False)
    torch.testing.assert_close(loaded(loaded.new_cache(8), *args), wide(wide.new_cache(8), *args), atol=0.02, rtol=0.02)


def test_bad_settings_are_refused_before_any_work() -> None:
    from splitllm.lab.training.build import DataSettings

    with pytest.raises(ValueError, match="--epochs must be at least 1"):
        train.TrainSettings(epochs=0)
    with pytest.raises(ValueError, match="needs some data"):
        DataSettings(prompts=0, texts=0)
    with pytest.raises(ValueError, match="--taps must be increasing"):
        DataSettings(taps=(26, 2))
    with pytest.raises(ValueError, match="--lr must be positive"):
        train.TrainSettings(lr=0)
    with pytest.raises(ValueError, match="--feature-weight must be at least 0"):
        train.TrainSettings(feature_weight=-1)
    with pytest.raises(ValueError, match="--generate-batch must be at least 1"):
        DataSettings(generate_batch=0)
    from splitllm.lab.training.training_commands import layer_counts

    assert layer_counts("2, 26") == (2, 26) and layer_counts("") == ()
    with pytest.raises(typer.BadParameter, match="--taps takes layer counts"):
        layer_counts("2;26")


@pytest.mark.slow
def test_follow_ups_are_answered_in_context_and_answers_cached(tmp_path) -> None:
    """A second user turn is answered after the model's own first answer; a rerun answers nothing again."""
    from splitllm.lab.privacy.tiny import tiny_model
    from splitllm.lab.training.build import Bar, DataSettings, answer_conversations

    files = ModelFiles(tiny_model(tmp_path / "model"))
    tok = data.load_tokenizer(files)
    (tmp_path / "work" / "features").mkdir(parents=True)
    conversations = [
        instructions.Instruction(("Say hello.", "Now make it shorter."), "conversation"),
        instructions.Instruction(("Name a colour.",), "conversation"),
    ]
    calls: list[int] = []

    def capture() -> FeatureCapture:
        calls.append(1)
        return FeatureCapture(files, torch.float32)

    settings = DataSettings(max_new_tokens=5)
    sequences, seconds = answer_conversations(capture, files, tok, conversations, settings, tmp_path / "work",
                                              Bar(None))
    first = data.chat_ids(tok, [data.turn("user", "Say hello.")])
    (alone, _), = FeatureCapture(files, torch.float32).answer([first], 5)
    reply = tok.decode(alone[len(first):], skip_special_tokens=True).strip()
    assert sequences[0][: len(first)] == first
    text = tok.decode(sequences[0])
    assert text.index("Say hello.") < text.index(reply) < text.index("Now make it shorter.")
    assert len(sequences[0]) == len(data.chat_ids(tok, [
        data.turn("user", "Say hello."), data.turn("assistant", reply), data.turn("user", "Now make it shorter.")
    ])) + 5
    assert seconds > 0 and calls
    calls.clear()
    again, cached_seconds = answer_conversations(capture, files, tok, conversations, settings, tmp_path / "work",
                                                 Bar(None))
    assert again == sequences and cached_seconds == pytest.approx(seconds) and not calls


def test_training_resumes_after_its_last_saved_epoch(trainee, tmp_path) -> None:
    """A run stopped in its second epoch and started again ends with the weights of one uninterrupted run."""
    files, client_model, target, seqs = trainee
    settings = train.TrainSettings(vocab=64, epochs=2, passes=2, batch_tokens=64)
    vocab = list(range(64))
    torch.manual_seed(0)
    whole = train.new_drafter(client_model, vocab)
    train.train(whole, target, seqs, settings)
    checkpoint = tmp_path / "training.pt"

    def stop_once_saved(_tokens: int, _loss: float | None) -> None:
        if checkpoint.is_file():
            raise KeyboardInterrupt

    torch.manual_seed(0)
    with pytest.raises(KeyboardInterrupt):
        train.train(train.new_drafter(client_model, vocab), target, seqs, settings, stop_once_saved, checkpoint)
    torch.manual_seed(1)  # the resumed run takes its weights from the checkpoint, not from its start
    resumed = train.new_drafter(client_model, vocab)
    history = train.train(resumed, target, seqs, settings, checkpoint=checkpoint)
    assert history["steps"] > 2
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_each_model_trains_by_its_recipe_unless_told_otherwise() -> None:
    """The larger model answers fewer conversations with a narrower drafter, so both fit about an hour;
    what a user gives wins, and the metadata's command names the recipe's choices."""
    from splitllm.lab.training.recipes import GENERIC, recipe_for

    default, qwen = recipe_for(None), recipe_for("qwen2.5-coder-1.5b")
    assert default == recipe_for("default") and default.prompts > qwen.prompts
    assert qwen.intermediate == 2048 and default.intermediate is None
    assert recipe_for("path/to/other.gguf") == GENERIC
    mine = qwen.given(prompts=10, epochs=None, generate_batch=None, weights="float16", intermediate=None)
    assert (mine.prompts, mine.weights, mine.epochs, mine.intermediate) == (10, "float16", qwen.epochs, 2048)
    assert mine.as_options(["epochs", "intermediate"]) == ["--epochs", str(qwen.epochs), "--intermediate", "2048"]
    assert default.as_options(["intermediate"]) == []  # the target's width: nothing to ask for
    # a continued drafter's width, which --init refuses to change
    assert qwen.continuing().as_options(["intermediate"]) == []


@pytest.mark.slow
def test_draft_train_records_the_recipe_it_ran(tmp_path) -> None:
    """Through the command line: what the options left out comes from the recipe, and the metadata's
    command asks for it explicitly."""
    import subprocess
    import sys

    from splitllm.lab.privacy.tiny import tiny_model
    from splitllm.lab.training.recipes import GENERIC

    model = tiny_model(tmp_path / "model")
    args = ["drafter", "train", "--model", str(model), "--out", str(tmp_path / "drafter"), "--prompts", "2",
            "--texts", "0", "--max-new-tokens", "3", "--vocab", "16", "--passes", "1", "--epochs", "1",
            "--work", str(tmp_path / "work")]
    subprocess.run([sys.executable, "-m", "splitllm.cli", *args], check=True, capture_output=True, timeout=300)
    meta = json.loads((tmp_path / "drafter" / store.METADATA).read_text())
    assert meta["reproduce"] == " ".join(["splitllm", *args, "--generate-batch", str(GENERIC.generate_batch),
                                          "--weights", GENERIC.weights])
    assert meta["weights_dtype"] == GENERIC.weights and meta["training_data"]["prompts"] == 2
