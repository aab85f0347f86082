"""Attack-free reference points: guessing uniformly, and always guessing the most frequent tokens."""

from __future__ import annotations

import torch


def uniform(vocab: int, k: int = 5) -> tuple[float, float]:
    """Expected (top-1, top-k) recovery of uniform guessing."""
    return 1.0 / vocab, k / vocab


def most_frequent(train_labels: torch.Tensor, test_labels: torch.Tensor, k: int = 5) -> tuple[float, float]:
    """(top-1, top-k) recovery of always answering the training set's most frequent tokens."""
    ids, counts = torch.unique(train_labels, return_counts=True)
    top = ids[counts.argsort(descending=True)[:k]]
    hit = test_labels.flatten()[:, None] == top[None]
    return float(hit[:, 0].float().mean()), float(hit.any(-1).float().mean())


def summary(vocab: int, train_labels: torch.Tensor, test_labels: torch.Tensor) -> dict[str, float]:
    (u1, u5), (f1, f5) = uniform(vocab), most_frequent(train_labels, test_labels)
    return {"uniform_top1": u1, "uniform_top5": u5, "most_frequent_top1": f1, "most_frequent_top5": f5}
