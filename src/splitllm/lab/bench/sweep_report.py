"""What `splitllm bench sweep` writes: raw steps (to re-analyze), a summary JSON, a Markdown table, plots."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from splitllm.lab.bench.sweep import (
    ADAPTIVE,
    Config,
    Point,
    Quiet,
    Run,
    cross_validate,
    parse_points,
    predict,
    predicted_speed,
    records,
    run_sweep,
    shapes,
)
from splitllm.decoding.sizing.auto_profile import AutoProfile
from splitllm.decoding.sizing.budget import SpecBudget
from splitllm.decoding.sizing.latency import LatencyProfile, Link, StepShape
from splitllm.model.precision import Precision
from splitllm.stats import SpeculationMetrics, StepStats, mean_stats

PARTS = {  # stacked-bar segments: label -> mean step timings summed
    "first stage": ("first_ms",),
    "last stage + LM head": ("last_ms",),
    "decoder": ("decode_ms",),
    "(de)serialize + other": ("serialize_ms", "deserialize_ms", "other_ms"),
    "server": ("server_ms",),
    "network": ("network_ms",),
}


def save_runs(runs: Sequence[Run], path: Path) -> None:
    data = [
        {
            "point": asdict(r.point),
            "config": {**asdict(r.config), "budget": asdict(r.config.budget) if r.config.budget else None},
            "rtt_ms": r.rtt_ms,
            "steps": [s.flat() for s in r.steps],
            "prefills": [s.flat() for s in r.prefills],
            "other_cores": r.other_cores,
        }
        for r in runs
    ]
    path.write_text(json.dumps(data))


def load_runs(path: Path) -> list[Run]:
    runs = []
    for d in json.loads(path.read_text()):
        c = d["config"]
        config = Config(c["label"], c["decoder"], SpecBudget(**c["budget"]) if c["budget"] else None)
        run = Run(Point(**d["point"]), config, d["rtt_ms"])
        run.steps = [StepStats.from_flat(s) for s in d["steps"]]
        run.prefills = [StepStats.from_flat(s) for s in d["prefills"]]
        run.other_cores = d.get("other_cores", [])
        runs.append(run)
    return runs


def summarize(runs: Sequence[Run]) -> dict:
    """Measured vs predicted (cross-validated) tok/s, the physical-limit fraction, auto vs best fixed."""
    cv = cross_validate(runs)
    full = LatencyProfile.fit(records(runs))
    fitted = predict(runs, runs, full)
    rows = []
    for i, r in enumerate(runs):
        shape = StepShape.of(r.steps)
        measured = r.tokens_per_second
        rows.append(
            {
                "point": r.point.label,
                "rtt_nominal_ms": r.point.rtt_ms,
                "bandwidth_mbit": r.point.bandwidth_mbit,
                "rtt_measured_ms": r.rtt_ms,
                "config": r.config.label,
                "decoder": r.config.decoder,
                "steps": len(r.steps),
                "tokens": SpeculationMetrics.of(r.steps).tokens,
                "tokens_per_second": measured,
                "predicted_cv": cv[i],
                "error_cv": (cv[i] - measured) / measured,
                "predicted_fit": fitted[i],
                "tokens_per_step": shape.accepted,
                "nodes_per_step": shape.nodes,
                "ideal_tokens_per_second": r.ideal_tokens_per_second,
                "fraction_of_ideal": measured / r.ideal_tokens_per_second,
                "mean_step": mean_stats(r.steps),
                "other_cores_max": max(r.other_cores, default=0.0),
            }
        )
    configs = list(dict.fromkeys(r["config"] for r in rows))
    mape = {c: _mean([abs(r["error_cv"]) for r in rows if r["config"] == c]) for c in configs}
    mape["overall"] = _mean([abs(r["error_cv"]) for r in rows])
    versus = []
    for point in dict.fromkeys(r["point"] for r in rows):
        here = {r["config"]: r["tokens_per_second"] for r in rows if r["point"] == point}
        if ADAPTIVE not in here:
            continue
        best = max((c for c in here if c != ADAPTIVE), key=here.__getitem__)
        versus.append(
            {"point": point, "auto": here[ADAPTIVE], "best_fixed": best, "best_fixed_tokens_per_second": here[best],
             "ratio": here[ADAPTIVE] / here[best]}
        )
    return {"runs": rows, "mape": mape, "auto_vs_best_fixed": versus, "profile": full.to_json()}


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def markdown(summary: dict, command: str) -> str:
    rows = summary["runs"]
    points = list(dict.fromkeys(r["point"] for r in rows))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    cell = {(r["config"], r["point"]): r for r in rows}
    rtt = {r["point"]: r["rtt_measured_ms"] for r in rows}
    out = [
        "# Tokens per second against RTT",
        "",
        f"Reproduce: `{command}`",
        "",
        "Measured / predicted tok/s (prediction: latency model fitted on the other links, leave-one-link-out).",
        "",
        "| mode | " + " | ".join(f"{p} (ping {rtt[p]:.1f})" for p in points) + " | MAPE |",
        "| --- |" + " ---: |" * (len(points) + 1),
    ]
    for c in configs:
        cells = [f"{cell[c, p]['tokens_per_second']:.2f} / {cell[c, p]['predicted_cv']:.2f}" for p in points]
        out.append(f"| {c} | " + " | ".join(cells) + f" | {100 * summary['mape'][c]:.1f}% |")
    def per_point(title: str, caption: str, key: str, digits: int) -> list[str]:
        """A section with one table: a row per mode, a column per link, each cell one field of the run."""
        lines = ["", f"## {title}", "", caption, "", "| mode | " + " | ".join(points) + " |",
                 "| --- |" + " ---: |" * len(points)]
        return lines + [
            f"| {c} | " + " | ".join(f"{cell[c, p][key]:.{digits}f}" for p in points) + " |" for c in configs
        ]

    out += ["", f"Overall MAPE: **{100 * summary['mape']['overall']:.2f}%** over {len(rows)} runs."]
    out += per_point(
        "Fraction of the physical limit",
        "Measured tok/s over accepted-per-step / (RTT + wire transfer + client compute + server compute).",
        "fraction_of_ideal", 3,
    )
    out += per_point(
        "Disturbance",
        "Most CPU (cores) other processes used during any generation of the run (the machine has 2).",
        "other_cores_max", 2,
    )
    out += ["", "## auto against the best fixed mode", "", "| link | auto tok/s | best fixed | its tok/s | ratio |",
            "| --- | ---: | --- | ---: | ---: |"]
    for v in summary["auto_vs_best_fixed"]:
        out.append(
            f"| {v['point']} | {v['auto']:.2f} | {v['best_fixed']} | {v['best_fixed_tokens_per_second']:.2f} "
            f"| {v['ratio']:.3f} |"
        )
    out += ["", "## Mean decode step (ms) and tokens per step", "", "| link | mode | tok/step | nodes | "
            + " | ".join(PARTS) + " | total |", "| --- | --- |" + " ---: |" * (len(PARTS) + 3)]
    for p in points:
        for c in configs:
            m = cell[c, p]["mean_step"]
            parts = [f"{sum(m[f] for f in fs):.1f}" for fs in PARTS.values()]
            out.append(
                f"| {p} | {c} | {cell[c, p]['tokens_per_step']:.2f} | {cell[c, p]['nodes_per_step']:.1f} | "
                + " | ".join(parts) + f" | {m['total_ms']:.1f} |"
            )
    return "\n".join(out) + "\n"


def plot(runs: Sequence[Run], summary: dict, folder: Path) -> list[Path]:
    """tok/s against RTT (measured points, model lines) and the stacked step decomposition."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["runs"]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    points = list(dict.fromkeys(r["point"] for r in rows))
    profile = LatencyProfile.from_json(summary["profile"])
    colors = {c: plt.get_cmap("tab10")(i % 10) for i, c in enumerate(configs)}
    fig, ax = plt.subplots(figsize=(9, 5.5))
    top = max(r["rtt_measured_ms"] for r in rows) * 1.05
    grid = [top * i / 100 for i in range(101)]
    for c in configs:
        mine = [r for r in rows if r["config"] == c]
        open_link = [r for r in mine if r["bandwidth_mbit"] is None]
        capped = [r for r in mine if r["bandwidth_mbit"] is not None]
        ax.plot([r["rtt_measured_ms"] for r in open_link], [r["tokens_per_second"] for r in open_link], "o",
                color=colors[c], label=c)
        ax.plot([r["rtt_measured_ms"] for r in capped], [r["tokens_per_second"] for r in capped], "s",
                color=colors[c], markerfacecolor="none")
        line = _model_line(runs, c, profile, grid)
        if line:
            ax.plot(grid, line, "-", color=colors[c], linewidth=1)
    ax.set_xlabel("measured RTT (ms); squares: bandwidth-capped link")
    ax.set_ylabel("decode tokens / s")
    ax.set_title("splitllm: measured (points) and latency model (lines)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    speed = folder / "tok_s_vs_rtt.png"
    fig.tight_layout()
    fig.savefig(speed, dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(points), figsize=(2.6 * len(points), 4.8), sharey=True)
    cell = {(r["config"], r["point"]): r["mean_step"] for r in rows}
    part_colors = plt.get_cmap("Set2")
    for ax, p in zip(axes if len(points) > 1 else [axes], points):
        bottom = [0.0] * len(configs)
        for j, (name, fs) in enumerate(PARTS.items()):
            heights = [sum(cell[c, p][f] for f in fs) for c in configs]
            ax.bar(range(len(configs)), heights, bottom=bottom, color=part_colors(j), label=name)
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set_title(p, fontsize=9)
        ax.set_xticks(range(len(configs)), configs, rotation=70, fontsize=7)
    (axes[0] if len(points) > 1 else axes).set_ylabel("mean decode step (ms)")
    (axes[-1] if len(points) > 1 else axes).legend(fontsize=7)
    fig.tight_layout()
    parts = folder / "step_decomposition.png"
    fig.savefig(parts, dpi=120)
    plt.close(fig)
    return [speed, parts]


def _model_line(runs: Sequence[Run], label: str, profile: LatencyProfile, grid: Sequence[float]) -> list[float]:
    """The model's tok/s for a config across RTTs (unlimited bandwidth)."""
    config = next(r.config for r in runs if r.config.label == label)
    known = shapes(runs)
    return [predicted_speed(config, Link(x), known, profile) for x in grid]


def write(runs: Sequence[Run], folder: Path, command: str) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    save_runs(runs, folder / "steps.json")
    summary = summarize(runs)
    summary["command"] = command
    summary["plots"] = [str(p) for p in plot(runs, summary, folder)]
    (folder / "sweep.json").write_text(json.dumps(summary, indent=1))
    summary["markdown"] = markdown(summary, command)
    (folder / "sweep.md").write_text(summary["markdown"])
    LatencyProfile.from_json(summary["profile"]).save(folder / "latency_profile.json")
    return summary


def sweep(
    out: str,
    points: str,
    per_category: int,
    max_new_tokens: int,
    profile: str | None,
    merge: bool,
    reanalyze: bool,
    command: str,
    quiet: Quiet = Quiet(),
    precision: Precision | None = None,
) -> dict:
    """The `bench sweep` command: measure (or reuse) runs, then write the report into `out`.

    `merge` re-measures only the given links and keeps the others' runs from `out`, with the auto
    profile calibrated the first time, so disturbed points can be redone alone.
    """
    folder = Path(out)
    steps, saved = folder / "steps.json", folder / "auto_profile.json"
    if reanalyze:
        return write(load_runs(steps), folder, command)
    wanted = parse_points(points)
    auto = AutoProfile.load(profile) if profile else AutoProfile.load(saved) if merge and saved.exists() else None
    folder.mkdir(parents=True, exist_ok=True)
    runs, auto = run_sweep(
        wanted, per_category, max_new_tokens, auto, str(folder / "server.log"), quiet, precision
    )
    auto.save(saved)
    if merge and steps.exists():
        runs = [r for r in load_runs(steps) if r.point not in wanted] + runs
    return write(runs, folder, command)
