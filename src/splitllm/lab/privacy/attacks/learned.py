"""What the learned attackers share: scoring against the public token embeddings, training, top-k.

Attackers map a hidden state to a feature vector in the embedding space and score every token by
cosine similarity with its public embedding (plus a learned per-token bias). Training is a softmax
over the tokens seen in training (cheap); evaluation ranks the whole vocabulary, so tokens never
seen in training can still be recovered where the state still carries their embedding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from splitllm.kernels import cpu_kernels
from splitllm.lab import rates


def rms_normalize(x: torch.Tensor) -> torch.Tensor:
    """States differ in scale by depth and position; attackers see them at unit RMS."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class EmbeddingScorer(nn.Module):
    """Cosine scores against frozen public embeddings, a learned temperature and per-token biases."""

    def __init__(self, embed: torch.Tensor, classes: torch.Tensor) -> None:
        super().__init__()
        table = F.normalize(embed.float(), dim=-1)
        self.register_buffer("table", table, persistent=False)
        self.register_buffer("classes", classes, persistent=False)  # sorted token ids seen in training
        self.register_buffer("class_table", table[classes].clone(), persistent=False)
        self.scale = nn.Parameter(torch.tensor(10.0))
        self.bias = nn.Parameter(torch.zeros(len(classes)))

    def class_index(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(self.classes, tokens)

    def train_logits(self, feats: torch.Tensor) -> torch.Tensor:
        return self.scale * F.normalize(feats, dim=-1) @ self.class_table.T + self.bias

    def vocab_logits(self, feats: torch.Tensor) -> torch.Tensor:
        """Over the whole vocabulary: tokens unseen in training get the lowest learned bias."""
        bias = self.bias.detach().min().expand(self.table.shape[0]).clone()
        bias[self.classes] = self.bias.detach()
        return self.scale.detach() * F.normalize(feats, dim=-1) @ self.table.T + bias


class Attacker(nn.Module):
    """A feature network (per position or per sequence) followed by the embedding scorer."""

    def __init__(self, features: nn.Module, scorer: EmbeddingScorer) -> None:
        super().__init__()
        self.features, self.scorer = features, scorer

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return self.features(rms_normalize(states))


def train(
    attacker: Attacker,
    states: torch.Tensor,
    labels: torch.Tensor,
    epochs: int,
    batch: int,
    lr: float,
    seed: int = 0,
) -> list[float]:
    """AdamW with a one-cycle schedule over examples along dim 0; returns the loss per epoch."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    target = attacker.scorer.class_index(labels)
    n = states.shape[0]
    steps = epochs * math.ceil(n / batch)
    params = [p for p in attacker.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    bfloat16 = cpu_kernels.native_bfloat16()  # bf16 matrix units: several times faster; float32 without them
    attacker.train()
    losses = []
    for _ in range(epochs):
        total = 0.0
        for idx in torch.randperm(n, generator=gen).split(batch):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bfloat16):
                logits = attacker.scorer.train_logits(attacker(states[idx]))
            loss = F.cross_entropy(logits.float().flatten(0, -2), target[idx].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach()) * len(idx)
        losses.append(total / n)
    attacker.eval()
    return losses


@torch.inference_mode()
def top_k(attacker: Attacker, states: torch.Tensor, k: int = 5, batch: int = 64) -> torch.Tensor:
    """(..., k) most likely token ids over the whole vocabulary, examples batched along dim 0."""
    attacker.eval()
    return torch.cat([attacker.scorer.vocab_logits(attacker(s)).topk(k, dim=-1).indices for s in states.split(batch)])


def recovery(predicted: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[dict, dict]:
    """(top-1, top-k) rates of positions whose token is the first / among the k predictions, over the
    positions where `mask` is True (all by default)."""
    hit = predicted == labels[..., None]
    first, anywhere = hit[..., 0], hit.any(-1)
    if mask is not None:
        first, anywhere = first[mask], anywhere[mask]
    return rates.of(first), rates.of(anywhere)
