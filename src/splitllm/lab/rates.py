"""Rates with their uncertainty: every share the audit reports carries a 95% Clopper-Pearson interval.

Clopper-Pearson is exact for independent trials and conservative otherwise; positions in one window
are not independent (a hard passage is hard throughout), so the intervals are per position and a
lower bound on the true uncertainty about the corpus, not about text in general.
"""

from __future__ import annotations

import torch

LEVEL = 0.95


def clopper_pearson(hits: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """The exact two-sided binomial interval for hits out of n."""
    from scipy.stats import beta  # the `privacy` extra: only the audit needs it

    alpha = 1 - level
    lo = 0.0 if hits == 0 else float(beta.ppf(alpha / 2, hits, n - hits + 1))
    hi = 1.0 if hits == n else float(beta.ppf(1 - alpha / 2, hits + 1, n - hits))
    return lo, hi


def rate(hits: int, n: int) -> dict:
    """{"rate", "hits", "n", "ci95"}: what the report stores for every share."""
    if n <= 0:
        raise ValueError("a rate needs at least one trial")
    return {"rate": hits / n, "hits": int(hits), "n": int(n), "ci95": list(clopper_pearson(int(hits), int(n)))}


def of(mask: torch.Tensor) -> dict:
    """The rate of True in a boolean tensor."""
    return rate(int(mask.sum()), mask.numel())
