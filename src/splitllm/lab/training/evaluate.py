"""Drafters compared on held-out conversations: acceptance per depth, conversation and code apart.

The conversations come from the held-out pools of `lab.data.instructions` (subjects, tasks and activities
no training prompt draws from, a share with a follow-up turn), answered by the target itself in the
precision the fastest split setting drafts from. Every drafter is scored on the same sequences, so two drafters
trained on different data compare on text neither has seen.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

from rich.progress import Progress

from splitllm.drafting.store import find_shipped, load_drafter, read_metadata
from splitllm.lab.data import instructions
from splitllm.lab.training import data, train
from splitllm.lab.training.build import Bar, DataSettings, answer_conversations, cached_features, feature_capture
from splitllm.model.ends import ModelEnds
from splitllm.weights.sources import ModelFiles, cache_root


def compare_drafters(
    model: str | None, drafters: list[str | None], per_kind: int = 48, depth: int = 5,
    settings: DataSettings = DataSettings(), work: str | Path | None = None, show_progress: bool = True,
) -> dict:
    """Held-out acceptance of each drafter (a folder, or None for the shipped one) per kind of conversation."""
    files = ModelFiles(model)
    work = Path(work) if work else cache_root() / "draft-data" / files.fingerprint[:16]
    (work / "features").mkdir(parents=True, exist_ok=True)
    tok = data.load_tokenizer(files)
    folders = [Path(h) if h else find_shipped(files.fingerprint) for h in drafters]
    if None in folders:
        raise ValueError(f"{files.path.name} ships no drafter; name a folder with --drafter")
    loaded = {str(h or "shipped"): load_drafter(files, f) for h, f in zip(drafters, folders)}
    target = train.Target(ModelEnds(files))
    taps = sorted({t for d in loaded.values() for t in d.taps})
    settings = replace(settings, taps=tuple(taps))
    capture = feature_capture(files, tok, settings)
    out: dict = {"model": files.path.name, "depth": depth, "drafters": {}, "kinds": {}}
    with Progress(disable=not show_progress) as progress:
        bar = Bar(progress)
        for kind, conversations in instructions.held_out(per_kind).items():
            seqs, _ = answer_conversations(capture, files, tok, conversations, settings, work, bar)
            held = train.prepare(cached_features(capture, files, seqs, settings, work, bar, kind), target)
            out["kinds"][kind] = {"conversations": instructions.describe(conversations),
                                  "tokens": sum(len(s) for s in seqs)}
            for name, drafter in loaded.items():
                out["drafters"].setdefault(name, {})[kind] = asdict(train.validate(drafter, target, held, depth))
    for name, folder in zip(loaded, folders):
        out["drafters"][name]["trained"] = read_metadata(folder).get("created")
    return out
