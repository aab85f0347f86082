"""`run_audit`: every attack at every split depth, every defense, then the report.

See docs/privacy.md for the threat model, the corpus and what the figures mean.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from transformers import AutoTokenizer

from splitllm.model.weights import ModelFiles
from splitllm.privacy.attacks import baselines
from splitllm.privacy.config import AuditConfig
from splitllm.privacy.corpus import build_corpus
from splitllm.privacy.defense_sweep import defense_sweep
from splitllm.privacy.report import write_report
from splitllm.privacy.states import PublicModel
from splitllm.privacy.sweep import Context, head_ms, input_side, log, output_side
from splitllm.threads import set_compute_threads


def run_audit(cfg: AuditConfig) -> dict:
    """Run the whole audit and write report.json, report.md and leakage.png under cfg.out_dir."""
    set_compute_threads(cfg.threads)
    start = time.perf_counter()
    files = ModelFiles(cfg.model)
    n = files.config.num_layers
    for k in cfg.heads + (cfg.defense_head,):
        files.config.check_split(k, 0)
    for m in cfg.tails + (cfg.defense_tail,):
        if not 0 <= m < n:
            raise ValueError(f"tail depth {m} must lie in [0, {n})")
    files.config.check_split(cfg.defense_head, cfg.defense_tail)
    tokenizer = AutoTokenizer.from_pretrained(files.path)
    corpus = build_corpus(tokenizer, cfg.window, cfg.train_positions, cfg.test_positions)
    cuts = sorted(set(cfg.heads) | {cfg.defense_head} | {n - m for m in cfg.tails} | {n - cfg.defense_tail, n})
    model = PublicModel(files, cuts)
    t0 = time.perf_counter()
    train, test = model.window_states(corpus.train, cuts), model.window_states(corpus.test, cuts)
    ctx = Context(cfg, files, corpus, model, train, test, {"states": time.perf_counter() - t0})
    log.info("corpus %s; states in %.0f s", corpus.describe(), ctx.timings["states"])

    input_rows, attackers = input_side(ctx)
    output_rows = output_side(ctx)
    defense = defense_sweep(ctx, attackers)
    vocab = files.config.vocab_size
    report = {
        "model": {"path": str(files.path), "layers": n, "hidden": files.config.hidden_size, "vocab": vocab},
        "corpus": corpus.describe(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items() if k != "model"}
        | {"whitebox_max_candidates": min(cfg.whitebox_max_candidates or vocab, vocab)},
        "baselines": {
            "input": baselines.summary(vocab, corpus.train, corpus.test),
            "output": baselines.summary(vocab, train.greedy, test.greedy),
        },
        "input_side": input_rows,
        "output_side": output_rows,
        "defenses": defense,
        "full_model_ms_per_step": head_ms(ctx, n),
        "seconds": {**ctx.timings, "total": time.perf_counter() - start},
    }
    write_report(report, cfg.out_dir)
    return report
