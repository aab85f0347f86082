"""`splitllm privacy ...`: the audit, the private head, and the docs tables generated from a report."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer

from splitllm.commands.options import fail, need_extra, numbers, reported

app = typer.Typer(no_args_is_help=True, help="What the server can learn from the hidden states.")


def _log_progress() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")


@app.command("audit")
def audit(
    model: Annotated[Optional[str], typer.Option(help="'default', 'gemma3', an HF folder or a .gguf file; --quick: a tiny random model")] = None,
    head: Annotated[Optional[str], typer.Option(help="comma-separated depths K (layers before the state is sent) (default: 1,2,4,6,8,12; --quick: 1,2)")] = None,
    tail: Annotated[Optional[str], typer.Option(help="comma-separated depths M (layers after the state is returned) (default: 0,1,2,4,8; --quick: 0,1)")] = None,
    out: Annotated[str, typer.Option(help="folder for report.json, report.md and leakage.png")] = "results/privacy",
    quick: Annotated[bool, typer.Option(help="tiny random model and small settings, and fail unless every attack behaves (CI)")] = False,
    reduced: Annotated[bool, typer.Option(help="the default model at K 2, M 0, small sets and one setting per defense (for a busy 2-core machine)")] = False,
    train_positions: Annotated[Optional[int], typer.Option(help="training positions for the learned attacks (default: 12288)")] = None,
    test_positions: Annotated[Optional[int], typer.Option(help="held-out positions (default: 3072)")] = None,
    whitebox_windows: Annotated[Optional[int], typer.Option(help="whole test windows the white-box search inverts (default: 6)")] = None,
    long_windows: Annotated[Optional[int], typer.Option(help="whole long contexts the white-box search also inverts (default: 2)")] = None,
    whitebox_max_candidates: Annotated[int, typer.Option(help="white-box candidates per position on defended states at most (0: whole vocabulary)")] = 8192,
    whitebox_exhaustive_positions: Annotated[Optional[int], typer.Option(help="positions per window searched over the whole vocabulary for collisions (default: 4; --reduced: 1; each costs a forward of every token through the first K layers)")] = None,
    update_docs: Annotated[bool, typer.Option(help="also publish the report to docs/privacy-audit and regenerate the tables in docs/privacy.md")] = False,
    threads: Annotated[int, typer.Option(help="compute threads")] = 1,
) -> None:
    """Train and run token-recovery attacks at each split depth, measure defenses, write a report."""
    from splitllm.lab.privacy.audit import run_audit
    from splitllm.lab.privacy.audit_config import AuditConfig
    from splitllm.lab.privacy.published import PUBLISHED
    from splitllm.lab.privacy.report_tables import markdown

    need_extra("privacy")
    _log_progress()
    settings: dict = dict(out_dir=Path(out), threads=threads)
    for name, value in (("heads", head), ("tails", tail)):
        if value:
            settings[name] = numbers(value, int)
    sizes = dict(train_positions=train_positions, test_positions=test_positions, whitebox_windows=whitebox_windows,
                 long_windows=long_windows, whitebox_exhaustive_positions=whitebox_exhaustive_positions)
    settings.update({name: n for name, n in sizes.items() if n is not None})
    if quick:
        cfg = AuditConfig.quick(**settings, **({"model": model} if model else {}))
    elif reduced:
        cfg = AuditConfig.reduced(model=model, **settings)
        if whitebox_max_candidates != 8192:
            cfg = replace(cfg, whitebox_max_candidates=whitebox_max_candidates or None)
    else:
        cfg = AuditConfig(model=model, whitebox_max_candidates=whitebox_max_candidates or None, **settings)
    with reported(ValueError):
        report = run_audit(cfg, quick=quick)
    typer.echo(markdown(report))
    typer.echo(f"wrote {out}/report.json, report.md, leakage.png", err=True)
    if update_docs:
        PUBLISHED.mkdir(parents=True, exist_ok=True)
        for name in ("report.json", "report.md", "leakage.png"):
            shutil.copy(Path(out) / name, PUBLISHED / name)
        docs(str(PUBLISHED / "report.json"))
    if report["checks"]:
        typer.echo("failed checks:\n- " + "\n- ".join(report["checks"]), err=True)
        raise typer.Exit(1)


@app.command("private-head")
def private_head(
    head: Annotated[str, typer.Option(help="comma-separated depths K to train a private first stage at")] = "2,4,8",
    steps: Annotated[int, typer.Option(help="fine-tuning steps per head")] = 40,
    kl_budget: Annotated[float, typer.Option(help="KL budget from the public next-token distribution (nats/token)")] = 0.05,
    length: Annotated[int, typer.Option(help="training window (tokens)")] = 64,
    train_positions: Annotated[int, typer.Option(help="training positions for the attackers")] = 6144,
    test_positions: Annotated[int, typer.Option(help="held-out positions")] = 3072,
    out: Annotated[str, typer.Option(help="folder for private_head.json")] = "results/privacy",
    quick: Annotated[bool, typer.Option(help="tiny random model and small settings")] = False,
    threads: Annotated[int, typer.Option(help="compute threads")] = 1,
) -> None:
    """Fine-tune the client's first K layers with a secret seed and attack them without the secret."""
    from splitllm.lab.privacy.audit_config import AuditConfig
    from splitllm.lab.privacy.audit import run_private_head

    _log_progress()
    settings: dict = dict(
        out_dir=Path(out), threads=threads, private_heads=numbers(head, int), private_steps=steps,
        private_kl_budget=kl_budget, private_length=length, long_windows=0,
    )
    if quick:
        cfg = AuditConfig.quick(**settings)
    else:
        sizes = dict(train_positions=train_positions, test_positions=test_positions, tails=(0,))
        cfg = AuditConfig(**sizes, whitebox_max_candidates=2048, defense_whitebox_windows=1, **settings)
    with reported(ValueError):
        result = run_private_head(cfg)
    typer.echo(json.dumps(result["private_head"], indent=1))


@app.command("docs")
def docs(
    report: Annotated[Optional[str], typer.Argument(help="the report.json to generate the tables from (default: the published one)")] = None,
) -> None:
    """Regenerate the privacy tables in the checkout's docs/privacy.md from a report."""
    from splitllm.lab import CHECKOUT
    from splitllm.lab.privacy.published import PUBLISHED, update_docs

    path = Path(report) if report else PUBLISHED / "report.json"
    if not path.is_file():
        fail(f"no report at {path}")
    changed = update_docs(path, CHECKOUT)
    typer.echo(f"updated {', '.join(map(str, changed))}" if changed else "docs already match the report")
