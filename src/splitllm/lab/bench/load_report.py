"""`splitllm bench load`'s report: scaling against one client, the Markdown tables, the plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def scaling(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per server kind: each client count's tok/s and p50 step against the same kind's single client."""
    out = []
    for r in rows:
        base = next((b for b in rows if b["server"] == r["server"] and b["clients"] == 1), None)
        if base is None or r["clients"] == 1 or not r["step_ms"] or not base["step_ms"]:
            continue
        out.append({
            "server": r["server"], "clients": r["clients"],
            "throughput_x": round(r["aggregate_tokens_per_s"] / base["aggregate_tokens_per_s"], 2),
            "p50_step_x": round(r["step_ms"]["p50"] / base["step_ms"]["p50"], 2),
        })
    return out


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"`{result['command']}` ({result['settings']['clients_compute']} clients)", "",
        "| server | clients | match solo | tok/s | vs 1 client | step p50 / p99 ms | p50 vs 1 client "
        "| server compute p50 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    factors = {(f["server"], f["clients"]): f for f in result["scaling"]}
    for r in result["rows"]:
        f = factors.get((r["server"], r["clients"]), {"throughput_x": 1.0, "p50_step_x": 1.0})
        step, compute = r["step_ms"], r["server_compute_ms"]
        lines.append(
            f"| {r['server']} | {r['clients']} | {r['correct_clients']}/{r['clients']} | {r['aggregate_tokens_per_s']} "
            f"| {f['throughput_x']}x | {step.get('p50')} / {step.get('p99')} | {f['p50_step_x']}x "
            f"| {compute.get('p50')} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Aggregate tok/s and p50 step latency against clients, one line per server kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, latency) = plt.subplots(1, 2, figsize=(11, 4))
    for kind in dict.fromkeys(r["server"] for r in rows):
        mine = [r for r in rows if r["server"] == kind and r["step_ms"]]
        xs = [r["clients"] for r in mine]
        speed.plot(xs, [r["aggregate_tokens_per_s"] for r in mine], marker="o", label=kind)
        latency.plot(xs, [r["step_ms"]["p50"] for r in mine], marker="o", label=kind)
    for ax, title in ((speed, "aggregate tokens/s"), (latency, "step latency p50, ms")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    speed.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary(r: dict[str, Any]) -> str:
    return (
        f"{r['correct_clients']}/{r['clients']} clients matched their solo runs, {len(r['errors'])} errors; "
        f"{r['aggregate_tokens_per_s']} tok/s aggregate over {r['wall_s']} s; step p50 {r['step_ms'].get('p50')} ms, "
        f"p99 {r['step_ms'].get('p99')} ms (server compute p50 {r['server_compute_ms'].get('p50')} ms); "
        f"KV peak {r['kv_bytes_peak'] / 2**20:.0f} MiB; server RSS peak {r['server_rss_peak_mib']:.0f} MiB"
    )


def prefill_markdown(r: dict[str, Any]) -> str:
    a, d = r["alone"], r["with_prefill"]
    return "\n".join([
        f"`{r['command']}`", "",
        "| decoders | with a prefill of | match solo | step p50 / p99 ms | p99 vs alone | prefill ms | prefill exact |",
        "|---|---|---|---|---|---|---|",
        f"| {r['decoders']} | (none) | {a['correct_clients']}/{a['clients']} "
        f"| {a['step_ms']['p50']} / {a['step_ms']['p99']} | 1.0x | | |",
        f"| {r['decoders']} | {r['prefill_positions']} positions | {d['correct_clients']}/{d['clients']} "
        f"| {d['step_ms']['p50']} / {d['step_ms']['p99']} | {r['p99_ratio']}x | {r['prefill_ms']} "
        f"| {r['prefill_ok']} |",
    ]) + "\n"
