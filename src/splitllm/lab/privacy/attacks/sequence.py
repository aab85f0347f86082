"""A sequence-aware attacker: it sees every hidden state of a window at once.

The server holds the whole sequence of states a session sends, so an attacker may use context. This
one stacks a small bidirectional transformer on a trained per-position attacker: the transformer's
output projection starts at zero, so training starts from the per-position attacker's answers and
only learns to correct them from the neighbours (an ambiguous state, a token the MLP never saw).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from splitllm.lab.privacy.attacks.learned import Attacker, train


class _Contextual(nn.Module):
    def __init__(self, per_position: nn.Module, d: int, width: int, layers: int, heads: int, max_len: int) -> None:
        super().__init__()
        self.per_position = per_position.requires_grad_(False)
        self.proj_in = nn.Linear(d, width)
        self.pos = nn.Parameter(torch.zeros(max_len, width))
        layer = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.proj_out = nn.Linear(width, d)
        nn.init.zeros_(self.proj_out.weight)
        nn.init.zeros_(self.proj_out.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, length, d) -> (batch, length, d)."""
        h = self.per_position(x)
        return h + self.proj_out(self.encoder(self.proj_in(h) + self.pos[: x.shape[1]]))


def sequence_attacker(
    states: torch.Tensor,
    labels: torch.Tensor,
    per_position: Attacker,
    width: int = 256,
    layers: int = 2,
    epochs: int = 8,
    seed: int = 0,
) -> Attacker:
    """Train on (n_windows, length, d) states with (n_windows, length) labels, on top of a trained
    per-position attacker (which is copied, not changed)."""
    torch.manual_seed(seed)
    base = copy.deepcopy(per_position)
    features = _Contextual(base.features, states.shape[-1], width, layers, heads=4, max_len=states.shape[1])
    attacker = Attacker(features, base.scorer)
    train(attacker, states, labels, epochs=epochs, batch=8, lr=1e-3, seed=seed)
    return attacker
