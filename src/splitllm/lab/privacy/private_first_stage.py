"""A private first stage: the client's first K layers fine-tuned with a secret seed, then attacked.

The client adds secret low-rank adapters (LoRA, their random start drawn from a secret seed) to every
matrix of its first K layers and trains them to push the state it sends away from what the public
layers would send (relative L2 distance, capped), while the public middle and last stage still produce the
next-token distribution the public model does: the KL from the public model's next-token
distribution is held under a budget by a multiplier raised whenever the KL exceeds it (dual ascent).
The server keeps running the public middle layers, so nothing about the secret ships to it.

The strongest server we can build without the secret then attacks the private states:
- white-box search with the public first K layers (proposals from its public-state attacker);
- the per-position attacker it trained on public-weight states, applied as is;
- the same two after unsupervised alignment: it sees many private states (not their text) and maps
  their distribution onto the public states' (matching means and covariances);
- for reference, an attacker trained on private states with their text (known plaintext).
"""

from __future__ import annotations

import copy
import math
import time

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from splitllm.client.client_model import ClientModel
from splitllm.client.pipeline import InProcessMiddle
from splitllm.model.stage import Stage
from splitllm.lab import heldout
from splitllm.lab.privacy.attacks.learned import Attacker, recovery, top_k
from splitllm.lab.privacy.states import WIRE_DTYPE
from splitllm.lab.privacy.depth_sweep import (
    Context,
    flat,
    fmt,
    first_stage_states,
    learned_attacks,
    log,
    whitebox_attack,
    whitebox_targets,
)

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FUSED = {  # the runtime's fused matrices, made of these projections
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


class _LoRA(nn.Module):
    """x -> W x + B A x: A starts random (from the secret seed), B at zero, so training starts public."""

    def __init__(self, base: nn.Linear, rank: int, gen: torch.Generator) -> None:
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(rank, base.in_features, generator=gen) / math.sqrt(base.in_features))
        self.b = nn.Parameter(torch.zeros(base.out_features, rank))
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        return out + F.linear(F.linear(x, self.a), self.b) if self.enabled else out

    def delta(self) -> torch.Tensor:
        return (self.b @ self.a).detach()


def _adapters(model: nn.Module, first: int, rank: int, seed: int) -> list[dict[str, _LoRA]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for layer in model.model.layers[:first]:
        found = {}
        for parent in (layer.self_attn, layer.mlp):
            for name in _PROJECTIONS:
                if hasattr(parent, name):
                    lora = _LoRA(getattr(parent, name), rank, gen)
                    setattr(parent, name, lora)
                    found[name] = lora
        out.append(found)
    return out


def train_private_first_stage(
    ctx: Context, first: int, seed: int, steps: int, kl_budget: float, rank: int, length: int, batch: int
) -> tuple[Stage, dict]:
    """Fine-tune the secret adapters; returns the private first stage as a `Stage` (adapters merged in)
    and the training trace's last values."""
    files = ctx.files
    model = AutoModelForCausalLM.from_pretrained(files.path, dtype=torch.float32)
    model.requires_grad_(False)
    adapters = _adapters(model, first, rank, seed)
    params = [p for layer in adapters for lora in layer.values() for p in (lora.a, lora.b)]
    opt = torch.optim.Adam(params, lr=2e-3)
    windows = ctx.corpus.train[:, :length]
    gen = torch.Generator().manual_seed(seed)
    weight, cap = 1.0, 1.0  # KL multiplier; the distance pushed for is capped (a state pushed 100% away is enough)
    kl = dist = torch.tensor(0.0)

    def set_enabled(on: bool) -> None:
        for layer in adapters:
            for lora in layer.values():
                lora.enabled = on

    model.train()
    for _ in range(steps):
        ids = windows[torch.randint(0, len(windows), (batch,), generator=gen)]
        with torch.no_grad():
            set_enabled(False)
            public = model(ids, output_hidden_states=True)
            set_enabled(True)
        private = model(ids, output_hidden_states=True)
        target = F.log_softmax(public.logits.float(), -1)
        kl = (target.exp() * (target - F.log_softmax(private.logits.float(), -1))).sum(-1).mean()
        h_pub, h_priv = public.hidden_states[first], private.hidden_states[first]
        dist = ((h_priv - h_pub).norm(dim=-1) / h_pub.norm(dim=-1)).clamp(max=cap).mean()
        loss = weight * kl - dist
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        kl, dist = kl.detach(), dist.detach()
        weight *= math.exp(0.5 * (float(kl) / kl_budget - 1.0))  # dual ascent on the KL budget
        weight = min(max(weight, 1e-2), 1e4)
    stage = Stage.load(files, 0, first, torch.float32)
    for layer, loras in zip(stage.layers, adapters):
        for fused, names in _FUSED.items():
            delta = torch.cat([loras[n].delta() for n in names])
            linear = getattr(layer, fused)
            linear.weight.data = linear.weight + delta
    return stage, {"train_kl_nats": float(kl), "train_distance": float(dist), "kl_weight": weight}


def align(source: torch.Tensor, target: torch.Tensor, eps: float = 1e-3) -> torch.Tensor:
    """The affine map taking the source states' mean and covariance to the target's (whitening then
    colouring), fitted on unpaired (n, d) samples: (d + 1, d) with the bias as the last row."""
    x, y = source.double(), target.double()
    mx, my = x.mean(0), y.mean(0)

    def root(c: torch.Tensor, power: float) -> torch.Tensor:
        vals, vecs = torch.linalg.eigh(c + eps * torch.eye(len(c), dtype=c.dtype) * c.diagonal().mean())
        return vecs @ torch.diag(vals.clamp_min(1e-12) ** power) @ vecs.T

    m = root(torch.cov(x.T), -0.5) @ root(torch.cov(y.T), 0.5)
    return torch.cat([m, (my - mx @ m)[None]]).float()


def _apply(states: torch.Tensor, affine: torch.Tensor) -> torch.Tensor:
    return (states.float() @ affine[:-1] + affine[-1]).to(WIRE_DTYPE)


def private_first_stage_sweep(ctx: Context, attackers: dict[int, Attacker]) -> list[dict]:
    """One row per K in cfg.private_first_depths: the stage's cost and every attacker's recovery."""
    cfg, n = ctx.cfg, ctx.n_layers
    labels = (ctx.corpus.train, ctx.corpus.test)
    windows = ctx.corpus.test[ctx.spread_windows(cfg.perplexity_windows)]
    rows = []
    for k in cfg.private_first_depths:
        t0 = time.perf_counter()
        public = attackers.get(k) or learned_attacks(
            ctx, k, ctx.train.states[k], ctx.test.states[k], labels, ctx.model.embed, sequence=False
        )[1]
        stage, trace = train_private_first_stage(
            ctx, k, cfg.seed + 5000 + k, cfg.private_steps, cfg.private_kl_budget, cfg.private_rank, cfg.private_length,
            batch=4,
        )
        client_model = ClientModel(ctx.files, k, 0)
        middle = Stage.load(ctx.files, k, n, torch.float32)
        plain = lambda middle=middle: InProcessMiddle(middle, windows.shape[1])  # noqa: E731
        reference = heldout.log_probs(client_model, plain, windows)
        private_client_model = copy.copy(client_model)
        private_client_model.first = stage
        row: dict = {"K": k, "kl_budget": cfg.private_kl_budget, "steps": cfg.private_steps, "rank": cfg.private_rank}
        row.update(trace)
        row.update(heldout.quality(windows, reference, heldout.log_probs(private_client_model, plain, windows)))
        train = first_stage_states(stage, ctx.model.embed, ctx.corpus.train)
        test = first_stage_states(stage, ctx.model.embed, ctx.corpus.test)
        pub_test = ctx.test.states[k]
        moved = (test.float() - pub_test.float()).norm(dim=-1) / pub_test.float().norm(dim=-1)
        row["state_distance"] = float(moved.mean())
        row["public_mlp_top1"] = recovery(top_k(public, flat(test)), labels[1].flatten())[0]
        wb = whitebox_attack(ctx, k, whitebox_targets(ctx, test), public, certify=False)
        row["whitebox_recovery"] = wb["whitebox_recovery"]
        # Unsupervised: the server's own private states (no text) aligned onto its public states.
        affine = align(flat(train), flat(ctx.train.states[k]))
        aligned = _apply(test, affine)
        row["aligned_mlp_top1"] = recovery(top_k(public, flat(aligned)), labels[1].flatten())[0]
        wb = whitebox_attack(ctx, k, whitebox_targets(ctx, aligned), public, certify=False)
        row["aligned_whitebox_recovery"] = wb["whitebox_recovery"]
        learned, _ = learned_attacks(ctx, k, train, test, labels, ctx.model.embed, sequence=False)
        row["known_plaintext_mlp_top1"] = learned["mlp_top1"]
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        log.info("private first stage K=%d: %s", k, fmt(row))
    return rows
