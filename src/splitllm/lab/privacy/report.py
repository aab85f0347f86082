"""The audit's report: report.json (everything), report.md (the tables), leakage.png (the plots)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from splitllm.lab.privacy.report_tables import markdown


def _frame(ax: Any, xlabel: str, ylabel: str, title: str, loc: str = "best") -> None:
    """One panel's labels, its 0-100% scale and legend: every panel plots rates."""
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title, ylim=(0, 102))
    ax.legend(fontsize=8, loc=loc)


def plot(r: dict, path: Path) -> None:
    import matplotlib  # the `privacy` extra; imported here so the runtime never needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    rows = r["input_side"]
    ks = [x["K"] for x in rows]
    ax = axes[0]
    for key, label in (
        ("mlp_top1", "MLP top-1"),
        ("mlp_top5", "MLP top-5"),
        ("sequence_top1", "sequence top-1"),
        ("whitebox_recovery", "white-box"),
    ):
        ax.plot(ks, [100 * x[key]["rate"] for x in rows], marker="o", label=label)
    ax.axhline(100 * r["baselines"]["input"]["most_frequent_top1"], ls="--", c="gray", label="most frequent token")
    _frame(ax, "K (layers on the client before sending)", "tokens recovered (%)", "Input side")

    ax = axes[1]
    out = r["output_side"]
    ms = [x["M"] for x in out]
    ax.plot(ms, [100 * x["probe_top1"]["rate"] for x in out], marker="o", label="learned probe top-1")
    ax.plot(ms, [100 * x["whitebox_agreement"]["rate"] for x in out], marker="s", label="white-box (public last stage)")
    ax.axhline(100 * r["baselines"]["output"]["most_frequent_top1"], ls="--", c="gray", label="most frequent")
    _frame(ax, "M (layers on the client after receiving)", "next token predicted (%)", "Output side")

    ax = axes[2]
    ms = [x["client_ms_per_step"] for x in rows]
    for key, label, marker in (
        ("whitebox_recovery", "input side, white-box", "o"),
        ("mlp_top1", "input side, MLP top-1", "^"),
    ):
        ax.plot(ms, [100 * x[key]["rate"] for x in rows], marker=marker, ls="", label=label)
    for x in rows:
        ax.annotate(
            f"K={x['K']}",
            (x["client_ms_per_step"], 100 * x["mlp_top1"]["rate"]),
            textcoords="offset points",
            xytext=(3, -12),
            fontsize=8,
        )
    ax.plot(
        [x["client_ms_per_step"] for x in out],
        [100 * x["whitebox_agreement"]["rate"] for x in out],
        marker="s",
        ls="",
        label="output side (M), white-box",
    )
    _frame(ax, "client compute per decoding step (ms, first stage K or last stage M)", "leakage (%)",
           "Leakage vs client compute",
           loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(r: dict, out_dir: Path) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(r, indent=2))
    (out_dir / "report.md").write_text(markdown(r))
    plot(r, out_dir / "leakage.png")
