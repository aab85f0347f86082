"""The audit's report as Markdown: a table per attack and defense, the results section docs/privacy.md
carries, its summary by first-stage depth, and report.md."""

from __future__ import annotations

from pathlib import Path

from splitllm.lab.data.corpus import KINDS


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _ci(r: dict) -> str:
    """A rate with its 95% interval, e.g. 97.9% (97.4-98.3)."""
    lo, hi = r["ci95"]
    return f"{100 * r['rate']:.1f}% ({100 * lo:.1f}-{100 * hi:.1f})"


def _of(r: dict) -> str:
    return f"{_ci(r)}, n={r['n']}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _cost(x: dict) -> list[str]:
    return [f"{x['perplexity']:.2f} (x{x['perplexity_ratio']:.2f})", f"{x['kl_nats']:.3f}", _ci(x["top1_agreement"])]


COST = ["perplexity", "KL (nats/token)", "top-1 unchanged"]


def input_table(r: dict) -> str:
    return _table(
        ["K", "client ms/step", "MLP top-1", "MLP top-5", "MLP top-1, 1,100 pairs", "sequence top-1",
         "white-box", "certified exact", "white-box, positions >= 256", "s/token", "candidates/token"],
        [
            [
                str(x["K"]),
                f"{x['client_ms_per_step']:.1f}",
                _ci(x["mlp_top1"]),
                _ci(x["mlp_top5"]),
                _ci(x["mlp_small_top1"]),
                _ci(x["sequence_top1"]),
                _of(x["whitebox_recovery"]),
                _ci(x["whitebox_certified"]),
                _of(x["whitebox_past_256"]) if "whitebox_past_256" in x else "-",
                f"{x['whitebox_seconds_per_token']:.2f}",
                f"{x['whitebox_candidates_per_token']:.0f}",
            ]
            for x in r["input_side"]
        ],
    )


def kind_table(r: dict) -> str:
    kinds = [k for k in KINDS if k in r["input_side"][0]["mlp_top1_by_kind"]]
    return _table(
        ["K"] + [f"{k}: MLP" for k in kinds] + [f"{k}: white-box" for k in kinds],
        [
            [str(x["K"])]
            + [_of(x["mlp_top1_by_kind"][k]) for k in kinds]
            + [_of(x["whitebox_by_kind"][k]) if k in x["whitebox_by_kind"] else "-" for k in kinds]
            for x in r["input_side"]
        ],
    )


def output_table(r: dict) -> str:
    return _table(
        ["M", "client ms/step", "probe top-1", "probe top-5", "white-box (public last stage)"],
        [
            [
                str(x["M"]),
                f"{x['client_ms_per_step']:.1f}",
                _ci(x["probe_top1"]),
                _ci(x["probe_top5"]),
                _ci(x["whitebox_agreement"]),
            ]
            for x in r["output_side"]
        ],
    )


def sampling_table(r: dict) -> str:
    rows = r.get("output_sampling", [])
    return _table(
        ["temperature", "server's top-1 is the sampled token", "sampled token in server's top-5",
         "expected (mean top-1 probability)"],
        [[f"{x['temperature']:g}", _ci(x["top1_hit"]), _ci(x["top5_hit"]), _pct(x["expected_top1"])] for x in rows],
    )


def noise_table(rows: list[dict], first: str, label, config: dict) -> str:  # type: ignore[no-untyped-def]
    """The MAP columns appear only for reports that carry them (older ones predate that attack)."""
    maps = [
        (key, name)
        for key, name in (
            ("map_likelihood", "MAP, likelihood only"),
            ("map_beam", f"MAP + LM prior, beam {config.get('map_beam_width')}"),
        )
        if any(key in x for x in rows)
    ]
    return _table(
        [first, "MLP top-1", "sequence top-1", "white-box"] + [name for _, name in maps] + COST,
        [
            [label(x), _ci(x["mlp_top1"]), _ci(x["sequence_top1"]), _of(x["whitebox_recovery"])]
            + [_of(x[key]) if key in x else "-" for key, _ in maps]
            + _cost(x)
            for x in rows
        ],
    )


def rotation_text(x: dict) -> str:
    return _table(
        ["attacker", "MLP top-1", "white-box"],
        [
            ["public weights only", _ci(x["public_weights_mlp_top1"]), _of(x["public_weights_whitebox_recovery"])],
            [
                f"key recovered from its own middle weights (error {x['key_error_from_server_weights']:.1e})",
                _ci(x["recovered_key_mlp_top1"]),
                _of(x["recovered_key_whitebox_recovery"]),
            ],
        ],
    ) + (
        f"\n\nFrom {x['known_pairs']} known (plaintext state, sent state) pairs the key is recovered with error "
        f"{x['key_error_from_known_pairs']:.1e}. Cost: perplexity x{x['perplexity_ratio']:.3f}, "
        f"KL {x['kl_nats']:.2e} nats, top-1 unchanged {_ci(x['top1_agreement'])}."
    )


def lowrank_table(rows: list[dict]) -> str:
    return _table(
        ["scale", "MLP (public weights)", "white-box (public weights)", "MLP (known plaintext)",
         "MLP (fitted map)", "white-box (fitted map)", "output white-box"] + COST,
        [
            [
                f"{x['scale']:g} (rank {x['rank']})",
                _ci(x["public_weights_mlp_top1"]),
                _ci(x["public_weights_whitebox_recovery"]),
                _ci(x["known_plaintext_mlp_top1"]),
                _ci(x["fitted_map_mlp_top1"]),
                _ci(x["fitted_map_whitebox_recovery"]),
                _ci(x["output_whitebox_agreement"]),
            ]
            + _cost(x)
            for x in rows
        ],
    )


def summary_table(r: dict) -> str:
    """The summary table (docs/privacy.md): leakage by first-stage depth K, with 95% intervals."""
    rows = r["input_side"]
    return _table(
        ["client layers before sending (K)"] + [str(x["K"]) for x in rows],
        [
            ["client ms per step"] + [f"{x['client_ms_per_step']:.1f}" for x in rows],
            ["tokens recovered, learned MLP"] + [_ci(x["mlp_top1"]) for x in rows],
            ["tokens recovered, white-box search"] + [_ci(x["whitebox_recovery"]) for x in rows],
            ["white-box positions certified exact"] + [_ci(x["whitebox_certified"]) for x in rows],
            ["white-box positions (of them past 256)"]
            + [f"{x['whitebox_recovery']['n']} ({x.get('whitebox_past_256', {'n': 0})['n']})" for x in rows],
        ],
    ) + (
        "\n\nNext token read off the returned state with the public last M layers: "
        + ", ".join(f"M={x['M']} {_ci(x['whitebox_agreement'])}" for x in r["output_side"])
        + f". {_provenance_line(r)}"
    )


def _provenance_line(r: dict) -> str:
    p, c = r["provenance"], r["corpus"]
    return (
        f"Rates with 95% Clopper-Pearson intervals; {c['test_positions']} held-out positions, commit "
        f"`{p['git_commit'][:10]}`, model `{p['model_fingerprint'][:12]}`, {r['seconds']['total'] / 60:.0f} min."
    )


def results(r: dict) -> str:
    """Every results table, as docs/privacy.md carries them."""
    parts = [
        _corpus_text(r), *_input_side(r), *_output_side(r), *_defenses(r["defenses"], r["config"]),
        *_private_first_stage(r),
    ]
    return "\n\n".join(p for p in parts if p)


def _corpus_text(r: dict) -> str:
    """The model and the positions every rate is measured on."""
    c = r["corpus"]
    return (
        f"Model: `{Path(r['model']['path']).name}` ({r['model']['layers']} layers, hidden {r['model']['hidden']}, "
        f"vocabulary {r['model']['vocab']}). {c['train_positions']} training and {c['test_positions']} test "
        f"positions in {c['window']}-token windows (test windows by kind: "
        + ", ".join(f"{k} {v}" for k, v in c["test_windows_by_kind"].items())
        + ")"
        + (
            f", plus {c['long_positions']} positions in whole {c['long_window']}-token contexts "
            "for the white-box search"
            if c["long_positions"]
            else ""
        )
        + f". {c['dedup']['test_windows_dropped']} of {c['dedup']['test_windows_considered']} candidate test "
        f"windows were dropped for sharing a {c['dedup']['ngram']}-token sequence with a training document. "
        "Every rate: 95% Clopper-Pearson interval in brackets (per position; n = positions)."
    )


def _input_side(r: dict) -> list[str]:
    base_in = r["baselines"]["input"]
    return [
        "### Input side: tokens recovered from the state after layer K",
        input_table(r),
        f"Baselines: uniform guess {_pct(base_in['uniform_top1'])}; most frequent token "
        f"{_pct(base_in['most_frequent_top1'])} (top-5 {_pct(base_in['most_frequent_top5'])}). White-box: "
        "certified search (whole vocabulary when no proposal matches); "
        + "; ".join(
            f"K={x['K']}: {x['whitebox_collisions']} collisions in {x['whitebox_exhaustive_positions']} "
            "whole-vocabulary positions"
            for x in r["input_side"]
        )
        + f". The full model takes {r['full_model_ms_per_step']:.1f} ms per step on this machine.",
        "### Input side by kind of text (top-1)",
        kind_table(r),
    ]


def _output_side(r: dict) -> list[str]:
    base_out = r["baselines"]["output"]
    parts = [
        "### Output side: the client's next token from the state before the last M layers",
        output_table(r),
        f"Baselines: uniform {_pct(base_out['uniform_top1'])}; most frequent next token "
        f"{_pct(base_out['most_frequent_top1'])}.",
    ]
    if r.get("output_sampling"):
        parts += [
            "### Output side under sampling: the server sees the distribution, not the draw",
            sampling_table(r),
        ]
    return parts


def _defenses(d: dict, config: dict) -> list[str]:
    return [
        f"### Defenses at first stage K={d['split']['first']}, last stage M={d['split']['last']}",
        f"Cost on {d['quality_positions']} held-out positions, teacher-forced, against the undefended split "
        f"(perplexity {d['undefended']['perplexity']:.2f}): perplexity, KL from the undefended next-token "
        "distribution, share of positions whose most likely next token is unchanged.",
        "Gaussian noise, std = sigma x the state's RMS (attackers know sigma and train on noised states):",
        noise_table(d["noise"], "sigma", lambda x: f"{x['sigma']:g}", config),
        "Differential privacy per token: states clipped to the median training-state norm "
        f"({d['dp_noise'][0]['clip']:.1f}) then the Gaussian mechanism (delta {d['dp_noise'][0]['delta']:g}):"
        if d["dp_noise"]
        else "",
        noise_table(d["dp_noise"], "epsilon (noise std)", lambda x: f"{x['epsilon']:g} ({x['sigma']:.1f})", config)
        if d["dp_noise"]
        else "",
        "Secret rotation of the residual stream (function-preserving; the server runs rotated middle weights):",
        rotation_text(d["rotation"]),
        "Secret low-rank perturbation of the client's layers (fitted map: least squares from known plaintext):",
        lowrank_table(d["lowrank"]),
    ]


def _private_first_stage(r: dict) -> list[str]:
    if not r.get("private_first_stage"):
        return []
    p = r.get("private_first_stage_provenance", r["provenance"])
    x = r["private_first_stage"][0]
    return [
        "### Private first stage: the client's first K layers fine-tuned with a secret seed",
        f"Secret LoRA adapters (rank {x['rank']}) on every matrix of the first K layers, {x['steps']} steps, "
        f"KL budget {x['kl_budget']:g} nats/token (commit `{p['git_commit'][:10]}`). Cost measured as above, "
        "against the undefended split at the same K; 'state moved': mean relative distance of the sent "
        "state from the public one.",
        private_first_stage_table(r["private_first_stage"]),
    ]


def private_first_stage_table(rows: list[dict]) -> str:
    return _table(
        ["K", "KL budget"] + COST
        + ["state moved", "white-box (public weights)", "MLP (public states)", "MLP (aligned)", "white-box (aligned)",
           "MLP (known plaintext)"],
        [
            [str(x["K"]), f"{x['kl_budget']:g}"]
            + _cost(x)
            + [
                f"{100 * x['state_distance']:.0f}%",
                _of(x["whitebox_recovery"]),
                _ci(x["public_mlp_top1"]),
                _ci(x["aligned_mlp_top1"]),
                _of(x["aligned_whitebox_recovery"]),
                _ci(x["known_plaintext_mlp_top1"]),
            ]
            for x in rows
        ],
    )


def markdown(r: dict) -> str:
    p = r["provenance"]
    head = [
        "# Privacy audit: what the server can learn from the hidden states",
        f"Commit `{p['git_commit']}`{' (uncommitted changes)' if p['git_dirty'] else ''}; model fingerprint "
        f"`{p['model_fingerprint']}`; libraries "
        + ", ".join(f"{k} {v}" for k, v in p["libraries"].items())
        + f"; seed {p['seeds']['base']}; total {r['seconds']['total'] / 60:.1f} min.",
    ]
    if r.get("checks"):
        head.append("Failed checks: " + "; ".join(r["checks"]))
    return "\n\n".join(head + [results(r)]) + "\n"

