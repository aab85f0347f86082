"""`splitllm draft train` end to end: data, features, training, validation, a drafter folder with metadata.

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

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from splitllm.client.local import LocalModel
from splitllm.lab.training import data, train
from splitllm.lab.training.capture import FeatureCapture
from splitllm.draft.store import FINGERPRINT_KEY, WEIGHT_FORMATS, save_drafter
from splitllm.model.weights import ModelFiles, cache_root


@dataclass(frozen=True)
class DataSettings:
    prompts: int = 480  # self-distillation prompts answered by the target (the shipped head's recipe)
    max_new_tokens: int = 160
    texts: int = 96  # passages of standard-library prose and code
    text_length: int = 256
    generate_batch: int = 32
    dtype: str = "bfloat16"  # the target's precision while answering and taking features
    seed: int = 0

    def __post_init__(self) -> None:
        if self.prompts < 0 or self.texts < 0 or self.prompts + self.texts == 0:
            raise ValueError("training needs some data: --prompts and --texts must be >= 0, not both 0")
        if self.max_new_tokens < 1 or self.text_length < 16 or self.generate_batch < 1:
            raise ValueError("--max-new-tokens must be at least 1")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--capture-dtype must be float32 or bfloat16, not {self.dtype!r}")


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


class _Bar:
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


def _feature_path(work: Path, files: ModelFiles, dtype: str, sequence: Sequence[int]) -> Path:
    return work / "features" / f"{_digest([files.fingerprint, dtype, list(sequence)])}.pt"


def _answers(
    capture: Callable[[], FeatureCapture], files: ModelFiles, tok, settings: DataSettings, work: Path, bar: _Bar
) -> tuple[list[list[int]], float]:
    """The target's answers, reusing a cached run over the same prompts (a longer one's prefix counts);
    their features are written to the feature cache in the same pass.

    The work folder keeps what each answering run cost (`seconds`), so a drafter built from cached answers
    still reports it."""
    prompts = data.build_prompts(settings.prompts, settings.seed)
    key = [files.fingerprint, settings.max_new_tokens, settings.seed, settings.dtype]
    path = work / f"answers-{_digest(key)}.json"
    cached = json.loads(path.read_text()) if path.is_file() else {"prompts": [], "sequences": [], "seconds": 0.0}
    n = len(cached["sequences"])
    if cached["prompts"][:n] == prompts[:n] and n >= len(prompts):
        return cached["sequences"][: len(prompts)], cached.get("seconds", 0.0) * len(prompts) / max(n, 1)
    done = cached["sequences"] if cached["prompts"][:n] == prompts[:n] else []
    seconds = cached.get("seconds", 0.0) if done else 0.0
    with bar.phase("answering prompts", len(prompts)) as advance:
        advance(len(done))
        for i in range(len(done), len(prompts), settings.generate_batch):
            t0 = time.perf_counter()
            chunk = [data.chat_ids(tok, p) for p in prompts[i : i + settings.generate_batch]]
            for ids, feats in capture().answer(chunk, settings.max_new_tokens):
                torch.save(feats, _feature_path(work, files, settings.dtype, ids))
                done.append(ids)
            seconds += time.perf_counter() - t0
            path.write_text(json.dumps({"prompts": prompts[: len(done)], "sequences": done, "seconds": seconds}))
            advance(len(chunk))
    return done, seconds


def _features(
    capture: Callable[[], FeatureCapture], files: ModelFiles, sequences: list[list[int]], settings: DataSettings,
    work: Path, bar: _Bar, name: str,
) -> data.Features:
    """Features of `sequences` (answers already have theirs), each cached under the digest of the model,
    the precision and its token ids."""
    paths = [_feature_path(work, files, settings.dtype, s) for s in sequences]
    missing = [i for i, p in enumerate(paths) if not p.is_file()]
    with bar.phase(f"features of {name}", len(missing)) as advance:
        for j in range(0, len(missing), settings.generate_batch):
            chunk = missing[j : j + settings.generate_batch]
            for i, feats in zip(chunk, capture().features([sequences[i] for i in chunk])):
                torch.save(feats, paths[i])
            advance(len(chunk))
    return data.Features([torch.tensor(s) for s in sequences], [torch.load(p).float() for p in paths])


def _split(seqs: list[train.Sequence_], share: float, seed: int) -> tuple[list[train.Sequence_], list[train.Sequence_]]:
    order = list(range(len(seqs)))
    random.Random(seed).shuffle(order)
    n_val = max(1, round(len(seqs) * share)) if len(seqs) > 1 else 0
    val = set(order[:n_val])
    return [s for i, s in enumerate(seqs) if i not in val], [s for i, s in enumerate(seqs) if i in val]


def build_head(
    model: str | None,
    out: str | Path,
    data_settings: DataSettings = DataSettings(),
    train_settings: train.TrainSettings = train.TrainSettings(),
    work: str | Path | None = None,
    weights: str = "float16",
    show_progress: bool = True,
    command: Sequence[str] | None = None,
) -> dict:
    """Build the data, train a drafter for `model`, validate it and write it to `out`; returns the metadata."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"--weights must be one of {', '.join(WEIGHT_FORMATS)}, not {weights!r}")
    files = ModelFiles(model)
    work = Path(work) if work else cache_root() / "draft-data" / files.fingerprint[:16]
    (work / "features").mkdir(parents=True, exist_ok=True)  # answers and their features
    tok = data.load_tokenizer(files)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, disable=not show_progress) as progress:
        bar = _Bar(progress)
        t0 = time.perf_counter()
        capture = functools.cache(lambda: FeatureCapture(files, getattr(torch, data_settings.dtype)))
        answers, answer_seconds = _answers(capture, files, tok, data_settings, work, bar)
        texts = data.text_sequences(tok, data_settings.texts, data_settings.text_length)
        evaluation = data.evaluation_prompts(tok)
        answers, overlap_a = data.drop_overlapping(answers, evaluation)
        texts, overlap_t = data.drop_overlapping(texts, evaluation)
        t1 = time.perf_counter()
        feats = {
            "answers": _features(capture, files, answers, data_settings, work, bar, "answers"),
            "text": _features(capture, files, texts, data_settings, work, bar, "text"),
        }
        t2 = time.perf_counter()
        local = LocalModel(files, 1, 0)
        target = train.Target(local)
        splits = {
            name: _split(train.prepare(f), train_settings.validation_share, train_settings.seed)
            for name, f in feats.items()
        }
        splits = {name: (tr, [replace(s, greedy=target.greedy(s.feats)) for s in val]) for name, (tr, val) in splits.items()}
        train_seqs = [s for tr, _ in splits.values() for s in tr]
        vocab = train.draft_vocabulary(train_seqs, train_settings.vocab, files.config.vocab_size)
        head = train.new_head(local, vocab, train_settings.intermediate)
        total = train_settings.epochs * sum(int(s.ids.numel()) for s in train_seqs)
        with bar.phase("training", total) as advance:
            history = train.train(head, target, train_seqs, train_settings, advance)
        t3 = time.perf_counter()
        validation = {
            name: asdict(train.validate(head, target, val, train_settings.validation_depth))
            for name, (_, val) in splits.items()
            if val
        }
        t4 = time.perf_counter()
    cfg = files.config
    meta = {
        FINGERPRINT_KEY: files.fingerprint,
        "model": files.path.name,
        "architecture": {
            "kind": "EAGLE-style: fc([feature, next embedding]) + one decoder layer of the target's shape",
            "target_model_type": cfg.model_type,
            "hidden_size": cfg.hidden_size,
            "num_heads": cfg.num_heads,
            "num_kv_heads": cfg.num_kv_heads,
            "feature": "output of the target's last decoder layer, before the final norm",
            "logits": "client's final norm and LM head rows of the draft vocabulary",
        },
        "training_data": {
            "description": (
                f"the target's own greedy answers (unsplit model in {data_settings.dtype}, batched, features taken "
                "in the same pass) to prompts built from templates "
                "over topic lists (everyday subjects, programming tasks, standard-library modules, Python "
                "Language Reference topics), plus chat-templated passages of "
                f"{data.corpus.SOURCE} from the privacy corpus' training documents only ({data.corpus.LICENCE}); "
                "labels are the target's own features and next-token distributions"
            ),
            **asdict(data_settings),
            "sequences": {name: len(f.ids) for name, f in feats.items()},
            "tokens": {name: f.tokens for name, f in feats.items()},
            "validation_sequences": {name: len(val) for name, (_, val) in splits.items()},
        },
        "evaluation_overlap": {
            "check": f"every training sequence against every evaluation prompt by shared {data.EVAL_NGRAM}-grams "
            "of tokens; sequences sharing one are dropped",
            "answers": overlap_a,
            "text": overlap_t,
        },
        "validation": validation,
        "training": history,
        "seconds": {
            "answering": round(answer_seconds, 1),  # when the work folder's answers were generated
            "data": round(t1 - t0, 1),
            "features": round(t2 - t1, 1),
            "training": round(t3 - t2, 1),
            "validation": round(t4 - t3, 1),
        },
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "reproduce": shlex.join(command) if command else None,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    save_drafter(head, out, meta, weights)
    return json.loads((Path(out) / "head.json").read_text())
