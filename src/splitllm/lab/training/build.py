"""`splitllm drafter train` end to end: data, features, training, validation, a drafter folder with metadata.

The expensive intermediate products (the target's answers, the features) are kept in a work folder
keyed by what produced them, so a rerun with other training settings skips straight to training.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import shlex
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from splitllm.client.stopping import stop_ids
from splitllm.lab.data import instructions
from splitllm.lab.training import data, train
from splitllm.lab.training.capture import FeatureCapture
from splitllm.drafting.drafter import Drafter
from splitllm.drafting.store import (
    FINGERPRINT_KEY,
    WEIGHT_FORMATS,
    find_shipped,
    load_drafter,
    read_metadata,
    save_drafter,
)
from splitllm.model.ends import ModelEnds
from splitllm.weights.sources import ModelFiles, cache_root


@dataclass(frozen=True)
class DataSettings:
    prompts: int = 480  # self-distillation conversations answered by the target
    follow_ups: float = 0.3  # share of conversations with a second user turn, answered in context
    max_new_tokens: int = 160
    texts: int = 96  # passages of standard-library prose and code
    text_length: int = 256
    generate_batch: int = 32
    dtype: str = "bfloat16"  # the target's precision while answering and taking features
    taps: tuple[int, ...] = ()  # layer counts whose outputs are taken beside the top feature (a tapped drafter's)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.prompts < 0 or self.texts < 0 or self.prompts + self.texts == 0:
            raise ValueError("training needs some data: --prompts and --texts must be >= 0, not both 0")
        if self.max_new_tokens < 1:
            raise ValueError("--max-new-tokens must be at least 1")
        if self.generate_batch < 1:
            raise ValueError("--generate-batch must be at least 1")
        if self.text_length < 16:
            raise ValueError("passages must be at least 16 tokens long")
        if not 0 <= self.follow_ups <= 1:
            raise ValueError(f"--follow-ups is a share of the conversations, in [0, 1], not {self.follow_ups}")
        if list(self.taps) != sorted(set(self.taps)) or any(t < 1 for t in self.taps):
            raise ValueError(f"--taps must be increasing layer counts, not {list(self.taps)}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--capture-dtype must be float32 or bfloat16, not {self.dtype!r}")


CAPTURE = "splitllm stack, greedy, batched"  # what answers; part of their cache key


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


class Bar:
    """One rich progress bar per phase, or nothing when quiet."""

    def __init__(self, progress: Progress | None) -> None:
        self.progress = progress

    @contextmanager
    def phase(self, name: str, total: int) -> Iterator[Callable[..., None]]:
        if self.progress is None:
            yield lambda *_: None
            return
        task = self.progress.add_task(name, total=total)

        def advance(n: int = 1, loss: float | None = None) -> None:
            desc = name if loss is None else f"{name} (loss {loss:.3f})"
            self.progress.update(task, advance=n, description=desc)

        yield advance
        self.progress.update(task, completed=total)


def _feature_path(work: Path, files: ModelFiles, settings: DataSettings, sequence: Sequence[int]) -> Path:
    taps = [list(settings.taps)] if settings.taps else []  # top features alone keep their key
    return work / "features" / f"{_digest([files.fingerprint, settings.dtype, list(sequence), *taps])}.pt"


def feature_capture(files: ModelFiles, tok, settings: DataSettings) -> Callable[[], FeatureCapture]:
    """The capture the settings ask for, built on first use (a run whose data is all cached never loads it)."""
    return functools.cache(lambda: FeatureCapture(files, getattr(torch, settings.dtype), stop_ids(tok, files.hf_config),
                                                  settings.taps))


def answer_conversations(
    capture: Callable[[], FeatureCapture], files: ModelFiles, tok, conversations: Sequence[instructions.Instruction],
    settings: DataSettings, work: Path, bar: Bar,
) -> tuple[list[list[int]], float]:
    """Token ids of every conversation with each user turn answered by the target in context, and the
    seconds answering them took; the features of each finished conversation go to the feature cache in
    the same pass.

    Answers are cached by their prompt's ids (with what each cost), so any run that asked the same
    question (another count, another share of follow-ups) reuses it. Prompts are answered in batches of
    similar length, so a batch pads little."""
    path = work / f"answers-{_digest([files.fingerprint, settings.max_new_tokens, settings.dtype, CAPTURE])}.json"
    cache = json.loads(path.read_text()) if path.is_file() else {"answers": {}, "seconds": {}}
    messages = [[data.turn("user", c.turns[0])] for c in conversations]
    done: list[list[int]] = [[] for _ in conversations]
    seconds = 0.0
    for depth in range(max((len(c.turns) for c in conversations), default=0)):
        live = [i for i, c in enumerate(conversations) if len(c.turns) > depth]
        prompts = {i: data.chat_ids(tok, messages[i]) for i in live}
        keys = {i: _digest(prompts[i]) for i in live}
        todo = sorted((i for i in live if keys[i] not in cache["answers"]), key=lambda i: len(prompts[i]))
        with bar.phase(f"answering turn {depth + 1}", len(todo)) as advance:
            for j in range(0, len(todo), settings.generate_batch):
                chunk = todo[j : j + settings.generate_batch]
                t0 = time.perf_counter()
                answers = capture().answer([prompts[i] for i in chunk], settings.max_new_tokens)
                each = (time.perf_counter() - t0) / len(chunk)
                for i, (ids, feats) in zip(chunk, answers):
                    if len(conversations[i].turns) == depth + 1:  # earlier turns' features come again in full
                        torch.save(feats, _feature_path(work, files, settings, ids))
                    cache["answers"][keys[i]], cache["seconds"][keys[i]] = ids, each
                path.write_text(json.dumps(cache))
                advance(len(chunk))
        for i in live:
            ids = cache["answers"][keys[i]]
            seconds += cache["seconds"][keys[i]]
            done[i] = ids
            if len(conversations[i].turns) > depth + 1:
                reply = tok.decode(ids[len(prompts[i]) :], skip_special_tokens=True).strip()
                messages[i] += [data.turn("assistant", reply), data.turn("user", conversations[i].turns[depth + 1])]
    return done, seconds


def cached_features(
    capture: Callable[[], FeatureCapture], files: ModelFiles, sequences: list[list[int]], settings: DataSettings,
    work: Path, bar: Bar, name: str,
) -> data.Features:
    """Features of `sequences` (answers already have theirs), each cached under the digest of the model,
    the precision and its token ids."""
    paths = [_feature_path(work, files, settings, s) for s in sequences]
    missing = [i for i, p in enumerate(paths) if not p.is_file()]
    with bar.phase(f"features of {name}", len(missing)) as advance:
        for j in range(0, len(missing), settings.generate_batch):
            chunk = missing[j : j + settings.generate_batch]
            for i, feats in zip(chunk, capture().features([sequences[i] for i in chunk])):
                torch.save(feats, paths[i])
            advance(len(chunk))
    return data.Features([torch.tensor(s) for s in sequences], [torch.load(p) for p in paths], settings.taps)


def _split(seqs: list[train.Sequence_], share: float, seed: int) -> tuple[list[train.Sequence_], list[train.Sequence_]]:
    order = list(range(len(seqs)))
    random.Random(seed).shuffle(order)
    n_val = max(1, round(len(seqs) * share)) if len(seqs) > 1 else 0
    val = set(order[:n_val])
    return [s for i, s in enumerate(seqs) if i not in val], [s for i, s in enumerate(seqs) if i in val]


@dataclass(frozen=True)
class _Build:
    """One build's target, settings, work folder (answers and features cached there) and progress bars."""

    files: ModelFiles
    data_settings: DataSettings
    train_settings: train.TrainSettings
    work: Path
    bar: Bar


@dataclass(frozen=True)
class _Products:
    """What a build made, as its metadata reports it."""

    conversations: list[instructions.Instruction]
    feats: dict[str, data.Features]  # by source: each kind of conversation, and "text"
    splits: dict[str, tuple[list[train.Sequence_], list[train.Sequence_]]]  # by source: training, validation
    overlap: dict[str, Any]  # by source: what sharing n-grams with the evaluation prompts dropped
    validation: dict[str, dict]
    history: dict
    seconds: dict[str, float]  # by phase


def build_drafter(
    model: str | None,
    out: str | Path,
    data_settings: DataSettings = DataSettings(),
    train_settings: train.TrainSettings = train.TrainSettings(),
    work: str | Path | None = None,
    weights: str = "float16",
    show_progress: bool = True,
    command: Sequence[str] | None = None,
    init: str | None = None,
) -> dict:
    """Build the data, train a drafter for `model`, validate it and write it to `out`; returns the metadata.

    The drafter reads the layers `data_settings.taps` names beside the top feature. `init` ("shipped" or a
    drafter folder): start from that drafter (its vocabulary and width) rather than from the target's last layer."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"--weights must be one of {', '.join(WEIGHT_FORMATS)}, not {weights!r}")
    files = ModelFiles(model)
    init_folder = _init_folder(files, init)
    start = None if init_folder is None else load_drafter(files, init_folder, packed=False)
    work = Path(work) if work else cache_root() / "draft-data" / files.fingerprint[:16]
    (work / "features").mkdir(parents=True, exist_ok=True)  # answers and their features
    tok = data.load_tokenizer(files)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, disable=not show_progress) as progress:
        build = _Build(files, data_settings, train_settings, work, Bar(progress))
        drafter, products = _phases(build, tok, start)
    save_drafter(drafter, out, _metadata(build, products, init_folder, command), weights)
    return json.loads((Path(out) / "drafter.json").read_text())


def _init_folder(files: ModelFiles, init: str | None) -> Path | None:
    """The drafter folder `init` names ("shipped": the one the package ships for the model), if any."""
    if init is None:
        return None
    folder = find_shipped(files.fingerprint) if init == "shipped" else Path(init)
    if folder is None:
        raise ValueError(f"{files.path.name} ships no drafter to start from")
    return folder


def _phases(build: _Build, tok, start: Drafter | None) -> tuple[Drafter, _Products]:
    """Every phase, timed: the data and its features (cached), then the drafter trained and validated."""
    t0 = time.perf_counter()
    capture = feature_capture(build.files, tok, build.data_settings)
    conversations, answer_seconds, sources, overlap = _sources(build, capture, tok)
    t1 = time.perf_counter()
    feats = {
        name: cached_features(capture, build.files, seqs, build.data_settings, build.work, build.bar, name)
        for name, seqs in sources.items()
        if seqs
    }
    t2 = time.perf_counter()
    ends = ModelEnds(build.files)
    target = train.Target(ends)
    ts = build.train_settings
    splits = {name: _split(train.prepare(f), ts.validation_share, ts.seed) for name, f in feats.items()}
    splits = {name: (tr, [replace(s, greedy=target.greedy(s.feats)) for s in val])
              for name, (tr, val) in splits.items()}
    drafter, history = _train(build, ends, target, [s for tr, _ in splits.values() for s in tr], start)
    t3 = time.perf_counter()
    validation = {
        name: asdict(train.validate(drafter, target, val, ts.validation_depth))
        for name, (_, val) in splits.items() if val
    }
    t4 = time.perf_counter()
    seconds = {
        "answering": round(answer_seconds, 1),  # when the work folder's answers were generated
        "data": round(t1 - t0, 1),
        "features": round(t2 - t1, 1),
        "training": round(t3 - t2, 1),
        "validation": round(t4 - t3, 1),
    }
    return drafter, _Products(conversations, feats, splits, overlap, validation, history, seconds)


def _sources(
    build: _Build, capture: Callable[[], FeatureCapture], tok
) -> tuple[list[instructions.Instruction], float, dict[str, list[list[int]]], dict[str, Any]]:
    """The conversations, the seconds their answers took, the training sequences by source (the answers
    by kind of conversation, and passages of text), and what sharing n-grams with the evaluation
    prompts dropped from each."""
    s = build.data_settings
    conversations = instructions.build(s.prompts, follow_up_share=s.follow_ups, seed=s.seed)
    answers, answer_seconds = answer_conversations(capture, build.files, tok, conversations, s, build.work, build.bar)
    sources = {kind: [a for a, c in zip(answers, conversations) if c.kind == kind] for kind in instructions.KINDS}
    sources["text"] = data.text_sequences(tok, s.texts, s.text_length)
    evaluation = data.evaluation_prompts(tok)
    overlap = {}
    for name, seqs in sources.items():
        sources[name], overlap[name] = data.drop_overlapping(seqs, evaluation)
    return conversations, answer_seconds, sources, overlap


def _train(
    build: _Build, ends: ModelEnds, target: train.Target, train_seqs: list[train.Sequence_], start: Drafter | None
) -> tuple[Drafter, dict]:
    """A new drafter (or `start`, continued) trained on `train_seqs`, checkpointed in the work folder."""
    ts = build.train_settings
    vocab = train.draft_vocabulary(train_seqs, ts.vocab, build.files.config.vocab_size)
    drafter = train.new_drafter(ends, vocab, ts.intermediate, build.data_settings.taps, start)
    total = ts.epochs * sum(int(s.ids.numel()) for s in train_seqs)
    with build.bar.phase("training", total) as advance:
        # which drafter it continues
        started = [] if start is None else [_digest(start.state_dict()["fc.weight"][:8].tolist())]
        key = _digest([build.files.fingerprint, asdict(build.data_settings), asdict(ts), *started])
        history = train.train(drafter, target, train_seqs, ts, advance, build.work / f"training-{key}.pt")
    return drafter, history


def _metadata(build: _Build, products: _Products, init_folder: Path | None, command: Sequence[str] | None) -> dict:
    """drafter.json: what the drafter is, what it learned from, how it validated, how to build it again."""
    files = build.files
    return {
        FINGERPRINT_KEY: files.fingerprint,
        "model": files.path.name,
        "architecture": _architecture(files, build.data_settings.taps),
        "training_data": _training_data(build.data_settings, products),
        "evaluation_overlap": {
            "check": f"every training sequence against every evaluation prompt by shared {data.EVAL_NGRAM}-grams "
            "of tokens; sequences sharing one are dropped",
            **products.overlap,
        },
        "validation": products.validation,
        "training": products.history,
        "continued_from": None if init_folder is None else read_metadata(init_folder).get("reproduce"),
        "seconds": products.seconds,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "reproduce": shlex.join(command) if command else None,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _architecture(files: ModelFiles, taps: tuple[int, ...]) -> dict[str, Any]:
    cfg = files.config
    return {
        "kind": "EAGLE-style: fc([feature, next embedding]) + one decoder layer of the target's shape"
        + (", the feature fused from the tapped layers' outputs and the top one (EAGLE-3)" if taps else ""),
        "target_model_type": cfg.model_type,
        "hidden_size": cfg.hidden_size,
        "num_heads": cfg.num_heads,
        "num_kv_heads": cfg.num_kv_heads,
        "feature": "output of the target's last decoder layer, before the final norm",
        "taps": "outputs of these layer counts, fused with the feature at committed positions: the split "
        "client's first-stage output and the middle's return for the split they match" if taps else None,
        "logits": "client's final norm and LM head rows of the draft vocabulary",
    }


def _training_data(data_settings: DataSettings, products: _Products) -> dict[str, Any]:
    return {
        "description": (
            f"the target's own greedy answers (unsplit model in {data_settings.dtype}, batched, features taken "
            f"in the same pass) to conversations built offline from {len(instructions.TRAINING.subjects)} "
            f"subjects, {len(instructions.TRAINING.tasks)} programming tasks in {len(instructions.LANGUAGES)} "
            f"languages, {len(instructions.TRAINING.activities)} everyday activities and "
            f"{len(instructions.TRAINING.concepts)} programming concepts through template families (explanation, "
            "advice, facts, comparison, creative writing, role play, arithmetic reasoning, rewriting, extraction "
            "and quizzes over library passages, letters, planning; implementing, explaining, reviewing and "
            "testing code, shell, SQL, data formats), a share with a follow-up user turn answered in context; "
            "plus chat-templated passages of "
            f"{data.corpus.SOURCE} from the privacy corpus' training documents only ({data.corpus.LICENCE}); "
            "labels are the target's own features and next-token distributions"
        ),
        **asdict(data_settings),
        "conversations": instructions.describe(products.conversations),
        "sequences": {name: len(f.ids) for name, f in products.feats.items()},
        "tokens": {name: f.tokens for name, f in products.feats.items()},
        "validation_sequences": {name: len(val) for name, (_, val) in products.splits.items()},
    }
