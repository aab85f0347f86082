"""White-box inversion: with the public weights of the first K layers, find the token whose state matches.

Left to right, for position t the attacker already holds its recovered prefix in a KV cache. It runs
candidate tokens as one batched step over that cache, every candidate seeing only the prefix and
itself (a forest of roots, `Visibility.from_parents([-1] * n)`), and compares each candidate's
layer-K state with the one it was sent. Undefended, the true token reproduces the state up to the
wire's rounding, so the search stops at the first exact match. Candidates are tried in the order of
proposals the attacker can compute from public weights (the public language model's next-token guess
on the recovered prefix, an attacker it trained on states it computed itself), so most positions
cost one small batch and the whole vocabulary is searched only when no proposal matches.

A certified search (as in SipIt) never gives up on an undefended state: when no proposed candidate
matches, it goes on through the rest of the vocabulary, so every position ends either with an exact
match (certified: this token reproduces the state sent) or with proof that no single token does.
Exact matches are unique in practice; to check, chosen positions are searched over the whole
vocabulary and every other token within tolerance is counted as a collision.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from functools import cache

import torch

from splitllm.lab.privacy.states import PublicModel, StageStack
from splitllm.model.visibility import Visibility

WIRE_TOLERANCE = 2e-3  # relative L2 distance a float16 wire leaves between equal states


@cache
def roots(n: int) -> Visibility:
    """n candidates that each see the committed prefix and themselves only."""
    return Visibility.from_parents([-1] * n)


def fuse_rankings(scores: Sequence[torch.Tensor], k: float = 60.0) -> torch.Tensor:
    """Reciprocal-rank fusion of several (V,) score vectors into one candidate order (best first)."""
    total = torch.zeros_like(scores[0], dtype=torch.float32)
    for s in scores:
        ranks = torch.empty_like(total)
        ranks[s.argsort(descending=True)] = torch.arange(len(s), dtype=torch.float32)
        total += 1.0 / (k + ranks)
    return total.argsort(descending=True)


class LanguageModelPrior:
    """The public model's next-token logits on the prefix recovered so far, one position per call."""

    def __init__(self, model: PublicModel, max_context: int) -> None:
        self.model = model
        self.caches = model.stack.new_caches(max_context)
        self.keep: list[int] = []

    @torch.inference_mode()
    def extend(self, token: int, position: int) -> torch.Tensor:
        out = self.model.stack.forward(
            self.caches, self.model.embed[[token]], torch.tensor([position]), Visibility.chain(1), self.keep
        )
        self.keep = [0]
        return self.model.logits(out[self.model.cfg.num_layers])[0]


@dataclass
class Inversion:
    tokens: list[int]
    candidates: list[int]  # how many candidates were run per position
    certified: list[bool]  # the chosen token reproduces the state within tolerance
    collisions: list[int]  # other tokens within tolerance seen at that position
    exhaustive: list[bool]  # the whole vocabulary was searched at that position
    seconds: float


def geometric_chunks(order: torch.Tensor, first: int, largest: int) -> list[torch.Tensor]:
    """Geometric chunks (first, 2*first, ... up to largest): an easy position costs one small step."""
    out, start, size = [], 0, first
    while start < len(order):
        out.append(order[start : start + size])
        start, size = start + size, min(size * 2, largest)
    return out


@torch.inference_mode()
def invert(
    stack: StageStack,
    embed: torch.Tensor,
    targets: torch.Tensor,
    proposals: Callable[[int, list[int]], list[torch.Tensor]],
    tolerance: float = WIRE_TOLERANCE,
    ratio: float = 0.5,
    max_candidates: int | None = None,
    chunk: tuple[int, int] = (64, 256),
    certify: bool = True,
    exhaustive: Collection[int] = (),
) -> Inversion:
    """Recover the tokens of one sequence from its (P, d) states after the stack's last layer.

    `proposals(t, recovered)` returns score vectors over the vocabulary to order the search by. The
    search at a position stops at a candidate within `tolerance` (relative L2: an exact match). With
    `certify` it otherwise searches the whole vocabulary and keeps the nearest token. Without it (for
    defended states, which never match exactly) it also stops at a candidate at most `ratio` times
    as far as the runner-up (a clear winner), or after `max_candidates`. Positions in `exhaustive`
    are searched over the whole vocabulary regardless, counting every other token within tolerance.
    A chunk of n candidates scores n x (prefix + n) attention pairs, of which only n x (prefix + 1)
    are seen, so chunks stop growing at a few hundred (`chunk`: first and largest).
    """
    t0 = time.perf_counter()
    n_pos, vocab = targets.shape[0], embed.shape[0]
    limit = vocab if certify else min(max_candidates or vocab, vocab)
    caches = stack.new_caches(n_pos + chunk[1])
    last = stack.cuts[-1]
    out = Inversion([], [], [], [], [], 0.0)
    keep: list[int] = []
    for t in range(n_pos):
        target = targets[t].float()
        norm = target.norm()
        full = t in exhaustive
        best, dists, n, close = -1, torch.full((2,), float("inf")), 0, 0
        for ids in geometric_chunks(fuse_rankings(proposals(t, out.tokens))[: vocab if full else limit], *chunk):
            states = stack.forward(caches, embed[ids], torch.full((len(ids),), t), roots(len(ids)), keep)[last]
            keep = []
            dist = (states.float() - target).norm(dim=-1) / norm
            n += len(ids)
            close += int((dist <= tolerance).sum())
            merged = torch.cat([dists, dist])
            top = merged.topk(2, largest=False)
            if top.indices[0] >= 2:
                best = int(ids[top.indices[0] - 2])
            dists = top.values
            if full:
                continue
            if dists[0] <= tolerance or (not certify and dists[0] <= ratio * dists[1]):
                break
        certified = bool(dists[0] <= tolerance)
        out.tokens.append(best)
        out.candidates.append(n)
        out.certified.append(certified)
        out.collisions.append(close - int(certified))
        out.exhaustive.append(full)
        # The chosen token becomes part of the prefix: append it, commit it with the next step's keep.
        stack.forward(caches, embed[[best]], torch.tensor([t]), Visibility.chain(1), keep)
        keep = [0]
    out.seconds = time.perf_counter() - t0
    return out
