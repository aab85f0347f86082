"""The audit's report: report.json (everything), report.md (the tables), leakage.png (the plots)."""

from __future__ import annotations

import json
from pathlib import Path


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def markdown(r: dict) -> str:
    base_in, base_out = r["baselines"]["input"], r["baselines"]["output"]
    c, d = r["corpus"], r["defenses"]
    wb_cap = r["config"]["whitebox_max_candidates"] or r["model"]["vocab"]
    parts = [
        "# Privacy audit: what the server can learn from the hidden states",
        f"Model: `{r['model']['path']}` ({r['model']['layers']} layers, hidden {r['model']['hidden']}, "
        f"vocabulary {r['model']['vocab']}). Corpus: {c['source']} ({c['licence']}); "
        f"{c['train_positions']} training positions from {c['train_documents']} documents, {c['test_positions']} "
        f"test positions from {c['test_documents']} other documents; {_pct(c['test_prose_share'])} of the test "
        "windows are prose, the rest Python code. States are rounded to float16, as on the wire.",
        "## Input side: tokens recovered from the state after layer K",
        _table(
            [
                "K",
                "client ms/step",
                "MLP top-1",
                "MLP top-5",
                "MLP top-1, 1,100 pairs",
                "sequence top-1",
                "white-box",
                "white-box s/token",
                "candidates/token",
            ],
            [
                [
                    str(x["K"]),
                    f"{x['client_ms_per_step']:.1f}",
                    _pct(x["mlp_top1"]),
                    _pct(x["mlp_top5"]),
                    _pct(x["mlp_small_top1"]),
                    _pct(x["sequence_top1"]),
                    f"{_pct(x['whitebox_recovery'])} of {x['whitebox_positions']}",
                    f"{x['whitebox_seconds_per_token']:.2f}",
                    f"{x['whitebox_candidates_per_token']:.0f}",
                ]
                for x in r["input_side"]
            ],
        ),
        f"Baselines: uniform guess {_pct(base_in['uniform_top1'])} (top-5 {_pct(base_in['uniform_top5'])}); "
        f"most frequent token {_pct(base_in['most_frequent_top1'])} (top-5 {_pct(base_in['most_frequent_top5'])}). "
        f"White-box: at most {wb_cap} candidates per position, tried in proposal order. "
        f"The full model takes {r['full_model_ms_per_step']:.1f} ms per step on this machine.",
        "## Output side: the client's next token from the state before the last M layers",
        _table(
            ["M", "client ms/step", "probe top-1", "probe top-5", "white-box (public tail)"],
            [
                [
                    str(x["M"]),
                    f"{x['client_ms_per_step']:.1f}",
                    _pct(x["probe_top1"]),
                    _pct(x["probe_top5"]),
                    _pct(x["whitebox_agreement"]),
                ]
                for x in r["output_side"]
            ],
        ),
        f"Baselines: uniform {_pct(base_out['uniform_top1'])}; "
        f"most frequent next token {_pct(base_out['most_frequent_top1'])}.",
        f"## Defenses at head K={d['split']['head']}, tail M={d['split']['tail']}",
        f"Undefended held-out perplexity: {d['undefended']['perplexity']:.2f}. Greedy match = mean share of each "
        "continuation identical to the undefended one before the first difference.",
        "### Gaussian noise on the sent states (std = sigma x the state's RMS; "
        "attackers know sigma and train on noisy states)",
        _table(
            ["sigma", "MLP top-1", "sequence top-1", "white-box", "perplexity", "greedy match", "identical outputs"],
            [
                [
                    f"{x['sigma']:g}",
                    _pct(x["mlp_top1"]),
                    _pct(x["sequence_top1"]),
                    _pct(x["whitebox_recovery"]),
                    f"{x['perplexity']:.2f} (x{x['perplexity_ratio']:.2f})",
                    _pct(x["greedy_match"]),
                    _pct(x["greedy_exact"]),
                ]
                for x in d["noise"]
            ],
        ),
        "### Secret rotation of the residual stream (function-preserving; the server runs rotated middle weights)",
        _rotation_md(d["rotation"]),
        "### Secret low-rank perturbation of the client's layers",
        _table(
            [
                "scale",
                "MLP (public weights)",
                "white-box (public weights)",
                "MLP (known plaintext)",
                "output white-box",
                "perplexity",
                "greedy match",
            ],
            [
                [
                    f"{x['scale']:g} (rank {x['rank']})",
                    _pct(x["public_weights_mlp_top1"]),
                    _pct(x["public_weights_whitebox_recovery"]),
                    _pct(x["known_plaintext_mlp_top1"]),
                    _pct(x["output_whitebox_agreement"]),
                    f"{x['perplexity']:.2f} (x{x['perplexity_ratio']:.2f})",
                    _pct(x["greedy_match"]),
                ]
                for x in d["lowrank"]
            ],
        ),
        f"Total audit time: {r['seconds']['total'] / 60:.1f} min.",
    ]
    return "\n\n".join(parts) + "\n"


def _rotation_md(x: dict) -> str:
    return _table(
        ["attacker", "MLP top-1", "white-box"],
        [
            ["public weights only", _pct(x["public_weights_mlp_top1"]), _pct(x["public_weights_whitebox_recovery"])],
            [
                f"key recovered from its own middle weights (error {x['key_error_from_server_weights']:.1e})",
                _pct(x["recovered_key_mlp_top1"]),
                _pct(x["recovered_key_whitebox_recovery"]),
            ],
        ],
    ) + (
        f"\n\nFrom {x['known_pairs']} known (plaintext state, sent state) pairs the key is recovered with error "
        f"{x['key_error_from_known_pairs']:.1e}. "
        f"Cost: perplexity {x['perplexity']:.2f} (x{x['perplexity_ratio']:.3f}), greedy match {_pct(x['greedy_match'])}."
    )


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
        ax.plot(ks, [100 * x[key] for x in rows], marker="o", label=label)
    ax.axhline(100 * r["baselines"]["input"]["most_frequent_top1"], ls="--", c="gray", label="most frequent token")
    ax.set(
        xlabel="K (layers on the client before sending)",
        ylabel="tokens recovered (%)",
        title="Input side",
        ylim=(0, 102),
    )
    ax.legend(fontsize=8)

    ax = axes[1]
    out = r["output_side"]
    ms = [x["M"] for x in out]
    ax.plot(ms, [100 * x["probe_top1"] for x in out], marker="o", label="learned probe top-1")
    ax.plot(ms, [100 * x["whitebox_agreement"] for x in out], marker="s", label="white-box (public tail)")
    ax.axhline(100 * r["baselines"]["output"]["most_frequent_top1"], ls="--", c="gray", label="most frequent")
    ax.set(
        xlabel="M (layers on the client after receiving)",
        ylabel="next token predicted (%)",
        title="Output side",
        ylim=(0, 102),
    )
    ax.legend(fontsize=8)

    ax = axes[2]
    ms = [x["client_ms_per_step"] for x in rows]
    for key, label, marker in (
        ("whitebox_recovery", "input side, white-box", "o"),
        ("mlp_top1", "input side, MLP top-1", "^"),
    ):
        ax.plot(ms, [100 * x[key] for x in rows], marker=marker, ls="", label=label)
    for x in rows:
        ax.annotate(
            f"K={x['K']}",
            (x["client_ms_per_step"], 100 * x["mlp_top1"]),
            textcoords="offset points",
            xytext=(3, -12),
            fontsize=8,
        )
    ax.plot(
        [x["client_ms_per_step"] for x in out],
        [100 * x["whitebox_agreement"] for x in out],
        marker="s",
        ls="",
        label="output side (M), white-box",
    )
    ax.set(
        xlabel="client compute per decoding step (ms, head K or tail M)",
        ylabel="leakage (%)",
        title="Leakage vs client compute",
        ylim=(0, 102),
    )
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(r: dict, out_dir: Path) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(r, indent=2))
    (out_dir / "report.md").write_text(markdown(r))
    plot(r, out_dir / "leakage.png")
