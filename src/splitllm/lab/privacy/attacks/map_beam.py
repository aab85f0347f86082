"""MAP decoding of noised states: the most likely text under the known noise model and the public LM.

The nearest-candidate search (`whitebox.invert` without certification) asks which token's state is
closest to the one sent. A server that knows the noise model asks the better question: which text
most likely produced every state sent? Given the clean state x, the defense sends N(mean(x),
std(x)^2) per coordinate (`defenses.GaussianNoise.moments`), rounded to the wire's float16; the
public model's next-token distribution is the prior. The log posterior of a text is then a sum over
positions, and a beam search keeps the `beam` best prefixes:

    score(prefix + c) = score(prefix) + log N(sent_t; mean(state(prefix + c)), std^2) + log p_LM(c | prefix)

The std is the one the defense used for that clean state, computed from each candidate's own clean
state (relative noise scales with the clean state's RMS, which the server computes exactly for each
candidate) rather than estimated from the noised state: that is the exact likelihood, and it keeps
the log-determinant term that tells a quiet state from a loud one.

Candidates per hypothesis come in the order of a learned attacker's ranking of the sent state fused
with the hypothesis's prior, in geometric chunks, until the best one fits the noise model (`fit`:
what the truth would pass but for a 1e-4 chance) and leads the runner-up by `MARGIN` nats, or a
cap: without noise the true token ends the search at once, as in the white-box search; under
heavy noise, where a wrong candidate fits too, the search runs to the cap and the scores decide.
Candidates that fail the fit are dropped from the beam while any candidate passes it. Each
hypothesis holds the public model's caches over its prefix (the first stage's layers give the
candidates' states, the rest the prior), so a chunk costs one batched step of every searching
hypothesis's candidates through the first stage, and a position one token per surviving hypothesis
through the model.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from splitllm.model.kv import KVCache
from splitllm.model.stage import Stage, Step
from splitllm.lab.privacy.attacks.whitebox import fuse_rankings, geometric_chunks, roots
from splitllm.lab.privacy.defenses import GaussianNoise
from splitllm.lab.privacy.states import PublicModel

WIRE_STD = 2.0**-11  # float16 rounding per coordinate, relative to the state's RMS (an upper bound)
FIT_Z = 4.0  # standard deviations a fitting candidate's statistics may lie from their expectation
MARGIN = 10.0  # nats by which a fitting candidate must lead the runner-up to end a hypothesis's search


@dataclass
class Fit:
    """How (n, d) clean candidate states explain one sent state under the noise model."""

    log_likelihood: torch.Tensor  # (n,) log density of the sent state
    fits: torch.Tensor  # (n,) the sent state is as close and as large as the truth would likely send


def fit(noise: GaussianNoise, sent: torch.Tensor, clean: torch.Tensor) -> Fit:
    """The defense's Gaussian, widened by the wire's rounding so that no noise at all stays finite.

    Two tests a true candidate passes but for about a 1e-4 chance each (`FIT_Z` standard deviations):
    its squared residual over the variance is chi-square with d degrees of freedom (mean d, std
    sqrt(2d)); and the sent state's squared norm is what its mean and variance predict (mean
    |m|^2 + d var, variance 4 var |m|^2 + 2 d var^2). The second rejects a state so large that its
    noise would explain anything (the first alone passes it under heavy relative noise).
    """
    mean, std = noise.moments(clean)
    m2 = mean.square().sum(-1)
    d = sent.shape[-1]
    var = std[:, 0].square() + WIRE_STD**2 * m2 / d
    y = sent.float()
    chi2 = (y - mean).square().sum(-1) / var
    norm_z = (y.square().sum() - m2 - d * var) / (4 * var * m2 + 2 * d * var.square()).sqrt()
    fits = (chi2 <= d + FIT_Z * math.sqrt(2 * d)) & (norm_z.abs() <= FIT_Z)
    return Fit(-0.5 * chi2 - 0.5 * d * torch.log(2 * math.pi * var), fits)


@dataclass
class _Hypothesis:
    tokens: list[int]
    score: float
    caches: list[KVCache]  # the public model over `tokens`, every entry committed
    log_prior: torch.Tensor | None  # (V,) log p_LM(next token | tokens); None for the empty prefix


@dataclass
class Decoding:
    tokens: list[int]  # the best final hypothesis
    score: float  # its log likelihood, plus its log prior if used
    candidates: int  # candidate states scored, over all positions and hypotheses
    seconds: float


def _step(
    stages: Sequence[Stage], caches: list[list[KVCache]], hidden: list[torch.Tensor], t: int
) -> list[torch.Tensor]:
    """One batched step at position t of several sequences (each: tokens that see only its committed
    prefix and themselves) through consecutive stages; their entries are left pending."""
    for i, stage in enumerate(stages):
        hidden = stage.forward_many([(c[i], Step(h, torch.full((len(h),), t), roots(len(h))))
                                     for c, h in zip(caches, hidden)])
    return hidden


def _order(h: _Hypothesis, learned: torch.Tensor) -> torch.Tensor:
    """Candidates for the hypothesis's next token, best first: the learned scores fused with its prior."""
    return fuse_rankings([learned] if h.log_prior is None else [learned, h.log_prior])


def _scored(
    noise: GaussianNoise, sent: torch.Tensor, h: _Hypothesis, ids: torch.Tensor, states: torch.Tensor, prior: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each candidate's hypothesis score (the prefix's, its log likelihood, its log prior if used)
    and whether it fits."""
    f = fit(noise, sent, states)
    score = h.score + f.log_likelihood
    if prior and h.log_prior is not None:
        score = score + h.log_prior[ids]
    return score, f.fits


def _decided(tried: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> bool:
    """The best candidate so far fits and leads the runner-up by `MARGIN` nats: a clear winner."""
    scores, fits = torch.cat([t[0] for t in tried]), torch.cat([t[1] for t in tried])
    top = scores.topk(min(2, len(scores)))
    runner_up = top.values[1] if len(top.values) > 1 else -math.inf
    return bool(fits[top.indices[0]]) and float(top.values[0] - runner_up) >= MARGIN


def _search(
    first: Sequence[Stage],
    embed: torch.Tensor,
    beams: list[_Hypothesis],
    orders: list[torch.Tensor],
    score: Callable[[_Hypothesis, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    chunk: tuple[int, int],
    t: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every hypothesis's candidates in its order, chunk by chunk, until a clear winner fits or its
    order runs out: (score, token, fits, hypothesis index) of every candidate tried."""
    chunks = [iter(geometric_chunks(order, *chunk)) for order in orders]
    tried: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = [[] for _ in beams]
    searching = list(range(len(beams)))
    while searching:
        ids = [next(chunks[i]) for i in searching]
        states = _step(first, [beams[i].caches for i in searching], [embed[x] for x in ids], t)
        for i, x, s in zip(searching, ids, states):
            tried[i].append((*score(beams[i], x, s), x))
        searching = [i for i in searching if not _decided(tried[i]) and sum(len(x) for *_,
                                                                            x in tried[i]) < len(orders[i])]
    for h in beams:
        for cache in h.caches[: len(first)]:
            cache.keep([])  # drop the candidates: the prefix is committed alone again
    rows = [(sc, fits, x, i) for i, per in enumerate(tried) for sc, fits, x in per]
    return (
        torch.cat([r[0] for r in rows]),
        torch.cat([r[2] for r in rows]),
        torch.cat([r[1] for r in rows]),
        torch.cat([torch.full((len(r[2]),), r[3]) for r in rows]),
    )


@torch.inference_mode()
def map_beam(
    model: PublicModel,
    first: int,
    sent: torch.Tensor,
    noise: GaussianNoise,
    learned: torch.Tensor,
    beam: int = 4,
    prior: bool = True,
    max_candidates: int = 512,
    smallest: int = 32,
) -> Decoding:
    """The most likely tokens of one sequence given its (P, d) sent states after layer `first`.

    `learned`: (P, V) a learned attacker's scores of each sent state. Each hypothesis tries
    candidates in the fused order of those scores and its prior, in geometric chunks from `smallest`,
    until a clear winner fits the noise model or `max_candidates` were tried; every candidate tried
    is scored.
    `prior=False` scores by the likelihood alone (the prior still orders the candidates).
    """
    t0 = time.perf_counter()
    stages = model.stack.stages
    n_first = len(model.stack.upto(first).stages)
    n_pos = sent.shape[0]
    largest = max(smallest, max_candidates // 2)
    beams = [_Hypothesis([], 0.0, model.stack.new_caches(n_pos + largest), None)]
    scored = 0
    for t in range(n_pos):
        orders = [_order(h, learned[t])[:max_candidates] for h in beams]
        score = partial(_scored, noise, sent[t], prior=prior)
        flat, tokens, fits, owner = _search(stages[:n_first], model.embed, beams, orders, score, (smallest, largest), t)
        scored += len(flat)
        # A candidate whose state fails the fit test is dropped while any candidate passes it.
        keep = fits if fits.any() else torch.ones_like(fits)
        best = flat.masked_fill(~keep, -math.inf).topk(min(beam, int(keep.sum()))).indices.tolist()
        beams = [
            _Hypothesis(beams[owner[i]].tokens + [int(tokens[i])], float(flat[i]), beams[owner[i]].caches, None)
            for i in best
        ]
        if t + 1 < n_pos:
            _extend(model, beams, t)
    return Decoding(beams[0].tokens, beams[0].score, scored, time.perf_counter() - t0)


def _extend(model: PublicModel, beams: list[_Hypothesis], t: int) -> None:
    """Give each new hypothesis its own caches (its parent's; a copy for a parent's second child on)
    with its last token committed through every layer, and the prior for its next token."""
    taken: set[int] = set()
    for h in beams:
        if id(h.caches) in taken:
            h.caches = copy.deepcopy(h.caches)
        taken.add(id(h.caches))
    hidden = _step(model.stack.stages, [h.caches for h in beams], [model.embed[h.tokens[-1:]] for h in beams], t)
    for h, out in zip(beams, hidden):
        for cache in h.caches:
            cache.keep([0])
        h.log_prior = F.log_softmax(model.logits(out)[0].float(), dim=-1)
