"""What the `--quick` audit must show, or the attacks are broken: each check is one way to break them.

- A learned attack that no longer learns scores at the most-frequent-token baseline.
- An output-side probe that no longer learns scores at its baseline too.
- A white-box search that stops inverting fails to certify exact matches.
- A white-box search that peeks at the true tokens would still "recover" the text of the negative
  control: states rotated by a key the attacker does not have, which no public-weight search can
  match. There it must score near zero.
"""

from __future__ import annotations

MARGIN = 0.0  # a learned attack's 95% lower bound must clear its baseline by this much


def quick_checks(report: dict) -> list[str]:
    """The failed checks, as sentences (empty when every attack behaves)."""
    failures = []
    base_in = report["baselines"]["input"]["most_frequent_top1"]
    base_out = report["baselines"]["output"]["most_frequent_top1"]
    for row in report["input_side"]:
        lo = row["mlp_top1"]["ci95"][0]
        if lo < base_in + MARGIN:
            failures.append(f"K={row['K']}: learned attack {lo:.3f} (lower bound) does not beat baseline {base_in:.3f}")
        if row["whitebox_certified"]["rate"] < 0.9 or row["whitebox_recovery"]["rate"] < 0.9:
            failures.append(f"K={row['K']}: white-box search no longer inverts undefended states")
    for row in report["output_side"]:
        lo = row["probe_top1"]["ci95"][0]
        if lo < base_out + MARGIN:
            failures.append(f"M={row['M']}: output probe {lo:.3f} (lower bound) does not beat baseline {base_out:.3f}")
        if row["whitebox_agreement"]["rate"] < 0.99:
            failures.append(f"M={row['M']}: the public last stage no longer reproduces the next token")
    control = report["defenses"]["rotation"]
    for key in ("public_weights_whitebox_recovery", "public_weights_mlp_top1"):
        if control[key]["ci95"][0] > base_in + MARGIN:
            failures.append(f"negative control: {key} = {control[key]['rate']:.3f} without the key (peeking?)")
    return failures
