"""`run_audit`: every attack at every split depth, every defense, then the report.

See docs/privacy.md for the threat model, the corpus and what the figures mean.
"""

from __future__ import annotations

import json
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path
from dataclasses import asdict

from transformers import AutoTokenizer

from splitllm.weights.sources import ModelFiles
from splitllm.lab.privacy.attacks import baselines
from splitllm.lab.privacy.audit_config import AuditConfig
from splitllm.lab.data.corpus import Corpus, build_corpus
from splitllm.lab.privacy.defense_sweep import defense_sweep
from splitllm.lab.privacy.checks import quick_checks
from splitllm.lab.privacy.private_first_stage import private_first_stage_sweep
from splitllm.lab.privacy.report import write_report
from splitllm.lab import CHECKOUT, rates
from splitllm.lab.privacy.states import TEMPERATURES, PublicModel
from splitllm.lab.privacy.depth_sweep import Context, first_ms, input_side, log, output_side
from splitllm.threads import set_compute_threads


def provenance(files: ModelFiles, corpus: Corpus, seed: int) -> dict:
    """What a published figure is tied to: the code's commit, the libraries, the weights, the text."""
    root = CHECKOUT

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    libraries = {}
    for name in ("torch", "transformers", "tokenizers", "numpy", "scipy", "splitllm"):
        try:
            libraries[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            libraries[name] = "absent"
    return {
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": git("status", "--porcelain", "--untracked-files=no", "src") not in ("", "unknown"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "libraries": libraries,
        "model_fingerprint": files.fingerprint,
        "corpus_sha256": corpus.describe()["sha256"],
        "seeds": {
            "base": seed,
            "derived": "corpus generator: base; attackers: base + K (or cut); noise: base + 100 + i; "
            "DP noise: base + 200 + i; rotation: base + 7; low-rank: base + 1000 + i",
        },
    }


def prepare(cfg: AuditConfig, first_depths: tuple[int, ...]) -> Context:
    """The corpus, the public model cut at every audited depth, and the states of every window."""
    set_compute_threads(cfg.threads)
    files = ModelFiles(cfg.model)
    n = files.config.num_layers
    for k in first_depths + (cfg.defense_first,):
        files.config.check_split(k, 0)
    for m in cfg.last_depths + (cfg.defense_last,):
        if not 0 <= m < n:
            raise ValueError(f"last-stage depth {m} must lie in [0, {n})")
    files.config.check_split(cfg.defense_first, cfg.defense_last)
    tokenizer = AutoTokenizer.from_pretrained(files.path)
    corpus = build_corpus(
        tokenizer, cfg.window, cfg.train_positions, cfg.test_positions, cfg.long_window, cfg.long_windows, seed=cfg.seed
    )
    cuts = sorted(set(first_depths) | {cfg.defense_first} | {n - m for m in cfg.last_depths} | {n - cfg.defense_last,
                                                                                                n})
    origin = provenance(files, corpus, cfg.seed)  # before anything runs: the code as it was started
    model = PublicModel(files, cuts)
    t0 = time.perf_counter()
    train, test = model.window_states(corpus.train, cuts), model.window_states(corpus.test, cuts)
    long = model.window_states(corpus.long, first_depths) if corpus.long.numel() else None
    ctx = Context(cfg, files, corpus, model, train, test, long, {"states": time.perf_counter() - t0}, origin)
    log.info("corpus %s; states in %.0f s", corpus.describe(), ctx.timings["states"])
    return ctx


def run_private_first_stage(cfg: AuditConfig) -> dict:
    """Only the private-first-stage experiment (its own attackers included): private_first_stage.json
    under cfg.out_dir."""
    start = time.perf_counter()
    ctx = prepare(cfg, cfg.private_first_depths)
    out = {
        "provenance": ctx.provenance,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "private_first_stage": private_first_stage_sweep(ctx, {}),
        "seconds": time.perf_counter() - start,
    }
    Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.out_dir) / "private_first_stage.json").write_text(json.dumps(out, indent=2))
    return out


def run_audit(cfg: AuditConfig, quick: bool = False) -> dict:
    """Run the whole audit and write report.json, report.md and leakage.png under cfg.out_dir."""
    start = time.perf_counter()
    ctx = prepare(cfg, tuple(sorted(set(cfg.first_depths) | set(cfg.private_first_depths))))
    files, corpus, n = ctx.files, ctx.corpus, ctx.n_layers
    train, test = ctx.train, ctx.test
    input_rows, attackers = input_side(ctx)
    output_rows = output_side(ctx)
    defense = defense_sweep(ctx, attackers)
    vocab = files.config.vocab_size
    report = {
        "provenance": ctx.provenance,
        "model": {"path": str(files.path), "layers": n, "hidden": files.config.hidden_size, "vocab": vocab},
        "corpus": corpus.describe(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items() if k != "model"}
        | {"whitebox_max_candidates": min(cfg.whitebox_max_candidates or vocab, vocab), "quick": quick},
        "baselines": {
            "input": baselines.summary(vocab, corpus.train, corpus.test),
            "output": baselines.summary(vocab, train.greedy, test.greedy),
        },
        "input_side": input_rows,
        "output_side": output_rows,
        "output_sampling": [
            {
                "temperature": t,
                "top1_hit": rates.of(test.sampled[t] == test.top5[..., 0]),
                "top5_hit": rates.of((test.sampled[t][..., None] == test.top5).any(-1)),
                "expected_top1": float(test.top_prob[t].mean()),
            }
            for t in TEMPERATURES
        ],
        "defenses": defense,
        "full_model_ms_per_step": first_ms(ctx, n),
        "seconds": {**ctx.timings, "total": time.perf_counter() - start},
    }
    if cfg.private_first_depths:
        report["private_first_stage"] = private_first_stage_sweep(ctx, attackers)
        report["seconds"]["total"] = time.perf_counter() - start
    report["checks"] = quick_checks(report) if quick else []
    write_report(report, cfg.out_dir)
    return report
