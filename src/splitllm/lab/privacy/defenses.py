"""What a client can do about leakage, and what each option costs it.

- Deeper splits: more layers on the client; cost = client compute per decoding step (`step_ms`).
- Gaussian noise on the states the client sends (`NoisyMiddle`, `add_noise`), or noise calibrated to
  a per-token differential-privacy budget after clipping (`DPNoise`); cost = output quality.
- Private client weights: the client's first stage (and last stage) differs from the public weights by a secret.
  `rotate_*` is function-preserving (an orthogonal change of basis of the residual stream, norms
  folded in) but the server must then run rotated middle weights too, and it recovers the rotation
  from those weights or a few known state pairs by orthogonal Procrustes (`procrustes`).
  `perturb_*` adds a secret low-rank term to the client's layers: the public weights no longer
  reproduce its states, at the price of changing what the model computes.
"""

from __future__ import annotations

import copy
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from splitllm.client.client_model import ClientModel
from splitllm.client.pipeline import Middle
from splitllm.model.quant import Linear
from splitllm.model.stage import Stage, Step
from splitllm.lab.privacy.states import StageStack
from splitllm.stats import StepTiming
from splitllm.model.visibility import Visibility


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.pow(2).mean(-1, keepdim=True).sqrt()


class GaussianNoise(ABC):
    """A noise defense the server knows exactly: given the clean state x, the state sent is
    N(mean(x), std(x)^2) independently per coordinate (`moments`), drawn by calling it."""

    @abstractmethod
    def moments(self, clean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(..., d) clean states -> (..., d) means and (..., 1) per-coordinate standard deviations."""

    def __call__(self, states: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        mean, std = self.moments(states)
        return (mean + torch.randn(mean.shape, generator=gen) * std).to(states.dtype)


@dataclass(frozen=True)
class RelativeNoise(GaussianNoise):
    """Gaussian noise of standard deviation sigma x the state's own RMS, per position."""

    sigma: float

    def moments(self, clean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = clean.float()
        return x, self.sigma * _rms(x)


@dataclass(frozen=True)
class DPNoise(GaussianNoise):
    """The Gaussian mechanism per sent state: clip its L2 norm to `clip`, add N(0, s^2) per coordinate
    with s = 2 clip sqrt(2 ln(1.25/delta)) / epsilon. Any two clipped states are at most 2 clip apart,
    so each state (each token's contribution) is (epsilon, delta)-differentially private."""

    clip: float
    epsilon: float
    delta: float = 1e-5

    @property
    def sigma(self) -> float:
        return 2 * self.clip * math.sqrt(2 * math.log(1.25 / self.delta)) / self.epsilon

    def moments(self, clean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = clean.float()
        x = x * (self.clip / x.norm(dim=-1, keepdim=True).clamp_min(self.clip))
        return x, torch.full((*x.shape[:-1], 1), self.sigma)


class NoisyMiddle:
    """A `Middle` whose input is noised first: what the server receives under a noise defense."""

    def __init__(self, inner: Middle, noise: GaussianNoise, seed: int) -> None:
        self.inner, self.noise = inner, noise
        self.gen = torch.Generator().manual_seed(seed)

    @property
    def max_context(self) -> int:
        return self.inner.max_context

    @property
    def overlaps(self) -> bool:
        return self.inner.overlaps

    @property
    def row_invariant(self) -> bool:
        return self.inner.row_invariant

    def step(self, step: Step, timing: StepTiming, while_waiting: Iterator[object] | None = None) -> torch.Tensor:
        return self.inner.step(step.with_inputs(self.noise(step.inputs, self.gen)), timing, while_waiting)


def random_rotation(d: int, seed: int) -> torch.Tensor:
    """A Haar-random orthogonal matrix: the secret of the rotation defense."""
    q, r = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def rotate_stage(stage: Stage, q: torch.Tensor) -> Stage:
    """The same layers acting on residual states x @ q: RMSNorm scales folded into the next matrices."""
    if stage.cfg.sandwich_norm:
        raise ValueError("the rotation defense needs norms only before each block; this model norms their outputs too")
    out = copy.deepcopy(stage)
    q = q.to(stage.dtype)
    for layer in out.layers:
        layer.qkv.weight.data = (layer.qkv.weight * layer.input_norm) @ q
        layer.gate_up.weight.data = (layer.gate_up.weight * layer.post_norm) @ q
        layer.o_proj.weight.data = q.T @ layer.o_proj.weight
        layer.down.weight.data = q.T @ layer.down.weight
        layer.input_norm.data = torch.ones_like(layer.input_norm)
        layer.post_norm.data = torch.ones_like(layer.post_norm)
    return out


def rotate_client_model(client_model: ClientModel, q: torch.Tensor) -> ClientModel:
    """The client's embedding, first and last stages and LM head in the rotated basis (same outputs)."""
    out = copy.copy(client_model)
    q = q.to(client_model.dtype)
    out.embed_weight = client_model.embed_weight @ q
    out.lm_head = Linear((client_model.lm_head.weight * client_model.norm) @ q)
    out.norm = torch.ones_like(client_model.norm)
    out.first = rotate_stage(client_model.first, q)
    out.last = rotate_stage(client_model.last, q) if client_model.last else None
    return out


def procrustes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The orthogonal q minimising ||a @ q - b||: how an attacker recovers a rotation."""
    u, _, vh = torch.linalg.svd(a.double().T @ b.double())
    return (u @ vh).float()


def linear_map(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The matrix m minimising ||a @ m - b|| (least squares): an attacker's guess at a secret linear
    change from known pairs."""
    return torch.linalg.lstsq(a.double(), b.double()).solution.float()


def rotation_from_weights(public: Stage, rotated: Stage) -> torch.Tensor:
    """The server's own rotated middle layer against the public one: one matrix gives the key away."""
    pub, rot = public.layers[0], rotated.layers[0]
    return procrustes(pub.qkv.weight * pub.input_norm, rot.qkv.weight)


def perturb_stage(stage: Stage, key: int, rank: int, scale: float) -> Stage:
    """Each matrix plus a secret rank-`rank` term of relative (Frobenius) size `scale`."""
    out = copy.deepcopy(stage)
    gen = torch.Generator().manual_seed(key)
    for layer in out.layers:
        for name in ("qkv", "o_proj", "gate_up", "down"):
            w = getattr(layer, name).weight
            delta = torch.randn(w.shape[0], rank, generator=gen) @ torch.randn(rank, w.shape[1], generator=gen)
            w.data = w + (scale * w.float().norm() / delta.norm() * delta).to(w.dtype)
    return out


def perturb_client_model(client_model: ClientModel, key: int, rank: int, scale: float) -> ClientModel:
    out = copy.copy(client_model)
    out.first = perturb_stage(client_model.first, key, rank, scale)
    out.last = perturb_stage(client_model.last, key + 1, rank, scale) if client_model.last else None
    return out


@torch.inference_mode()
def step_ms(
    stack: StageStack,
    start: Callable[[torch.Tensor], torch.Tensor],
    finish: Callable[[torch.Tensor], torch.Tensor],
    context: int = 128,
    steps: int = 24,
) -> float:
    """Fastest of `steps` one-token decoding steps through a stack after a `context`-token prefill, in
    ms: on a shared machine the minimum is the stable measure of the compute itself.

    `start` turns token ids into the stack's input (embedding lookup, or nothing for a last stage) and
    `finish` finishes the step (LM head for a last stage); an empty stack times just those.
    """
    caches = stack.new_caches(context + steps)
    tokens = torch.arange(context) % 1000

    def run(ids: torch.Tensor, positions: torch.Tensor, keep: list[int]) -> None:
        hidden = start(ids)
        if stack.stages:
            hidden = stack.forward(caches, hidden, positions, Visibility.chain(len(ids)), keep)[stack.cuts[-1]]
        finish(hidden)

    run(tokens, torch.arange(context), [])
    times, keep = [], list(range(context))
    for i in range(steps):
        t0 = time.perf_counter()
        run(tokens[i : i + 1], torch.tensor([context + i]), keep)
        times.append((time.perf_counter() - t0) * 1000)
        keep = [0]
    return min(times)
