"""`splitllm privacy ...`: the audit, the private first stage, and the docs tables generated from a report."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer

from splitllm.commands.wiring import Values, command, fail, need_extra, numbers, reported
from splitllm.options import PRIVACY_AUDIT, PRIVACY_PRIVATE_FIRST_STAGE, option

app = typer.Typer(no_args_is_help=True, help="What the server can learn from the hidden states.")


def _log_progress() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")


@command(app, PRIVACY_AUDIT, audit=Values)
def audit(audit: Values, out: str, threads: int) -> None:
    """Train and run token-recovery attacks at each split depth, measure defenses, write a report
    (report.json, report.md and leakage.png into --out)."""
    from splitllm.lab.privacy.audit import run_audit
    from splitllm.lab.privacy.published import PUBLISHED
    from splitllm.lab.privacy.report_tables import markdown

    need_extra("privacy")
    _log_progress()
    with reported(ValueError):
        report = run_audit(_audit_config(audit, out, threads), quick=audit.quick)
    typer.echo(markdown(report))
    typer.echo(f"wrote {out}/report.json, report.md, leakage.png", err=True)
    if audit.update_docs:
        PUBLISHED.mkdir(parents=True, exist_ok=True)
        for name in ("report.json", "report.md", "leakage.png"):
            shutil.copy(Path(out) / name, PUBLISHED / name)
        docs(str(PUBLISHED / "report.json"))
    if report["checks"]:
        typer.echo("failed checks:\n- " + "\n- ".join(report["checks"]), err=True)
        raise typer.Exit(1)


def _audit_config(audit: Values, out: str, threads: int) -> Any:
    """The AuditConfig of `privacy audit`'s options: --quick's or --reduced's sizes, else the full audit's,
    with what the options give in their place."""
    from splitllm.lab.privacy.audit_config import AuditConfig

    settings: dict = dict(out_dir=Path(out), threads=threads)
    for name, value in (("first_depths", audit.first), ("last_depths", audit.last)):
        if value:
            settings[name] = numbers(value, int)
    sizes = ("train_positions", "test_positions", "whitebox_windows", "long_windows", "whitebox_exhaustive_positions")
    settings.update({name: getattr(audit, name) for name in sizes if getattr(audit, name) is not None})
    candidates = audit.whitebox_max_candidates or None  # 0: the whole vocabulary
    if audit.quick:
        return AuditConfig.quick(**settings, **({"model": audit.model} if audit.model else {}))
    if audit.reduced:
        cfg = AuditConfig.reduced(model=audit.model, **settings)
        given = audit.whitebox_max_candidates != option(PRIVACY_AUDIT, "whitebox_max_candidates").default
        return replace(cfg, whitebox_max_candidates=candidates) if given else cfg
    return AuditConfig(model=audit.model, whitebox_max_candidates=candidates, **settings)


@command(app, PRIVACY_PRIVATE_FIRST_STAGE)
def private_first_stage(
    first: str, steps: int, kl_budget: float, length: int, train_positions: int, test_positions: int, out: str,
    quick: bool, threads: int,
) -> None:
    """Fine-tune the client's first K layers with a secret seed and attack them without the secret; writes
    private_first_stage.json into --out."""
    from splitllm.lab.privacy.audit_config import AuditConfig
    from splitllm.lab.privacy.audit import run_private_first_stage

    _log_progress()
    settings: dict = dict(
        out_dir=Path(out), threads=threads, private_first_depths=numbers(first, int), private_steps=steps,
        private_kl_budget=kl_budget, private_length=length, long_windows=0,
    )
    if quick:
        cfg = AuditConfig.quick(**settings)
    else:
        sizes = dict(train_positions=train_positions, test_positions=test_positions, last_depths=(0,))
        cfg = AuditConfig(**sizes, whitebox_max_candidates=2048, defense_whitebox_windows=1, **settings)
    with reported(ValueError):
        result = run_private_first_stage(cfg)
    typer.echo(json.dumps(result["private_first_stage"], indent=1))


@app.command("docs")
def docs(
    report: Annotated[str | None,
                      typer.Argument(help="the report.json to generate the tables from "
                                          "(default: the published one)")] = None,
) -> None:
    """Regenerate the privacy tables in the checkout's docs/privacy.md from a report."""
    from splitllm.lab import CHECKOUT
    from splitllm.lab.privacy.published import PUBLISHED, update_docs

    path = Path(report) if report else PUBLISHED / "report.json"
    if not path.is_file():
        fail(f"no report at {path}")
    changed = update_docs(path, CHECKOUT)
    typer.echo(f"updated {', '.join(map(str, changed))}" if changed else "docs already match the report")
