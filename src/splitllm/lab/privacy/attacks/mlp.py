"""The published attack, strengthened: a per-position MLP from one hidden state to its token.

It sees one position at a time, as in the original design; the residual connection lets it start
from "which embedding is this state closest to", which is already strong after a few layers.
"""

from __future__ import annotations

import torch
from torch import nn

from splitllm.lab.privacy.attacks.learned import Attacker, EmbeddingScorer, train


class _Residual(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return h + self.mlp(h)


def mlp_attacker(
    states: torch.Tensor, labels: torch.Tensor, embed: torch.Tensor, hidden: int = 1024, epochs: int = 12, seed: int = 0
) -> Attacker:
    """Train on (n, d) states with (n,) token labels."""
    torch.manual_seed(seed)
    attacker = Attacker(_Residual(states.shape[-1], hidden), EmbeddingScorer(embed, torch.unique(labels)))
    train(attacker, states, labels, epochs=epochs, batch=256, lr=2e-3, seed=seed)
    return attacker
