"""The drafter's proposer: a token tree grown EAGLE-2 style from the client's own top-layer features.

The drafter's cache mirrors the committed sequence: after every step the decoder hands over the true
features (tail output) of the positions it committed, and the next `propose` that drafts appends one
entry per such position t with input (f_t, embed(x_{t+1})), after dropping the previous tree's
speculative entries (steps that do not draft leave them waiting, so they cost nothing). The last
entry predicts the feature after the bonus token, whose logits over the draft vocabulary give the
tree's first level. Each later depth runs the best `beam` frontier nodes at
once (each sees the committed entries and its own ancestors) and offers every one's `top_k` tokens.

Node scores are estimated acceptance chances: the product along the path of the drafter's probability,
recalibrated per probability bin against the tokens actually committed. They depend only on the
committed history and features, never on the sampler's draws, so greedy output stays sequential's
and speculative sampling stays exact with the candidates treated as point masses.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from splitllm.decoding.budget import SpecBudget
from splitllm.decoding.calibration import Calibration, CalibrationConfig
from splitllm.decoding.proposers import Draft
from splitllm.draft.model import Drafter
from splitllm.model.precision import Precision

MIN_SCORE = 0.01  # nodes less likely than this are not expanded when no link cost says otherwise


class DraftingClient(Protocol):
    """What the drafter drafts with besides itself: the client's embedding, final norm and LM head
    (the client's `LocalModel`), and the drafter shipped or trained for the model, if any."""

    dtype: torch.dtype

    @property
    def drafter(self) -> Drafter | None: ...

    def embed(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def normed(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def lm_head_rows(self, ids: torch.Tensor) -> torch.Tensor: ...


@dataclass
class _Node:
    token: int
    parent: int  # index into the tree's nodes, -1: the root (the bonus token)
    depth: int
    q: float  # the drafter's probability of this token given its parent
    bin: int  # q's calibration bin
    score: float  # estimated chance that the whole path is accepted
    slot: int = -1  # its drafter-cache entry, once expanded
    children: list[int] = field(default_factory=list)


class DrafterProposer:
    """A Proposer whose drafts are single scored nodes of a tree (see `Draft.score`)."""

    name = "draft"

    def __init__(
        self,
        head: Drafter,
        local: DraftingClient,
        max_context: int,
        top_k: int = 6,
        beam: int = 4,
        calibration_config: CalibrationConfig = CalibrationConfig(),
    ) -> None:
        self.head, self.local, self.top_k, self.beam = head, local, top_k, beam
        self.cache = head.new_cache(max_context + 32 * beam)
        # Guesses only: bfloat16 drafts 4x faster than float32 here, and a drafter drafting in int8
        # reads its vocabulary's LM-head rows in int8 too (at 1.5B they weigh more than its layer).
        rows = local.lm_head_rows(head.vocab)
        precision = Precision(torch.bfloat16, head.quant, device=str(rows.device))
        self.vocab_head = precision.linear(precision.store_linear(rows))
        self.bins = calibration_config.head_bins
        self.calibration: Calibration[int] = Calibration(calibration_config.prior_weight)  # P(right | bin of q)
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []  # (first position, true features, taps) not in the cache yet
        self.next_position: int | None = None  # position of the next committed entry
        self.committed = 0  # drafter-cache entries holding committed positions
        self.tree: list[_Node] = []
        self.tree_start = 0  # history index of the tree's depth-1 tokens
        self.draft_ms = 0.0  # time spent drafting since the last take_draft_ms()

    def observe(self, start: int, features: torch.Tensor, taps: torch.Tensor | None = None) -> None:
        """True features (tail outputs) of newly committed fed positions start, start + 1, ..., and for
        a fused head the outputs of the layers it taps at those positions."""
        if (taps is None) != (not self.head.taps):
            raise ValueError(f"this drafter reads the outputs of layers {list(self.head.taps)} beside the features")
        if self.next_position is None:
            self.next_position = start
        self.pending.append((start, features.detach(), None if taps is None else taps.detach()))

    def take_draft_ms(self) -> float:
        ms, self.draft_ms = self.draft_ms, 0.0
        return ms

    def propose(self, history: Sequence[int], budget: SpecBudget) -> list[Draft]:
        t0 = time.perf_counter()
        try:
            self._resolve(history)
            self.tree = []
            if not budget.max_nodes or not budget.depth:
                return []  # the committed positions wait in `pending`: the next drafting step syncs them in one pass
            root = self._sync(history)
            if root is None:
                return []
            self.tree_start = len(history)
            self._grow(root, len(history) - 2, budget)
            return self._drafts()
        finally:
            self.cache.keep(list(range(self.cache.pending)))  # so the next crop finds every entry committed
            self.draft_ms += (time.perf_counter() - t0) * 1000

    def _sync(self, history: Sequence[int]) -> torch.Tensor | None:
        """Append the committed entries not in the cache yet; the predicted feature after the last one."""
        if not self.pending or self.next_position is None:
            return None
        features = torch.cat([f for _, f, _ in self.pending])
        taps = torch.cat([t for _, _, t in self.pending]) if self.head.taps else None
        first = self.pending[0][0]
        self.pending = []
        if first != self.next_position:
            raise ValueError(f"drafter fed position {first}, expected {self.next_position}")
        n = features.shape[0]
        positions = torch.arange(first, first + n)
        if first + n >= len(history):
            raise ValueError("every committed feature needs the token that followed it")
        self.cache.crop(self.committed)
        sees = torch.cat([torch.ones(n, self.committed, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], 1)
        embeddings = self.local.embed(torch.tensor(history[first + 1 : first + n + 1]))
        out = self.head.grow(self.cache, features, embeddings, positions, sees, taps)
        self.committed += n
        self.next_position = first + n
        return out[-1:]

    def _probs(self, guesses: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary distributions of the tokens after predicted features."""
        normed = self.local.normed(guesses.to(self.local.dtype)).to(torch.bfloat16)
        return torch.softmax(self.vocab_head(normed).float(), dim=-1)

    def _offer(self, parents: list[int], outputs: torch.Tensor, depth: int) -> None:
        """Add the top_k children of each parent (-1: root), given its drafter output."""
        q, idx = self._probs(outputs).topk(min(self.top_k, self.vocab_head.out_features), dim=-1)
        bins = (q * self.bins).long().clamp_(0, self.bins - 1)
        # Plain lists from here: a tree's few dozen offers cost microseconds, not a tensor read each.
        rows = zip(parents, self.head.vocab[idx].tolist(), q.tolist(), bins.tolist())
        for parent, tokens, probs, prob_bins in rows:
            base = 1.0 if parent < 0 else self.tree[parent].score
            for token, p, b in zip(tokens, probs, prob_bins):
                score = base * min(max(self.calibration.rate(b, p), 1e-4), 0.99)
                self.tree.append(_Node(token, parent, depth, p, b, score))
                if parent >= 0:
                    self.tree[parent].children.append(len(self.tree) - 1)

    def _grow(self, root_out: torch.Tensor, last: int, budget: SpecBudget) -> None:
        """Grow the tree after the bonus token; `last`: the position of the last committed entry."""
        max_depth = min(budget.depth, self.head.cfg.max_position - last)
        # A node less likely than this is not worth verifying even first (see NodeCost): nor expanding.
        floor = budget.cost.node_ms / budget.cost.step_ms if budget.cost and budget.cost.step_ms > 0 else MIN_SCORE
        self._offer([-1], root_out, 1)
        outputs: dict[int, torch.Tensor] = {}
        for depth in range(1, max_depth):
            level = [i for i, nd in enumerate(self.tree) if nd.depth == depth and nd.score >= floor]
            chosen = sorted(sorted(level, key=lambda i: -self.tree[i].score)[: self.beam])
            room = self.cache.max_context - self.cache.length - self.cache.pending
            chosen = chosen[:room]
            if not chosen:
                return
            offset = self.cache.length + self.cache.pending
            n = len(chosen)
            sees = torch.zeros(n, offset + n, dtype=torch.bool)
            sees[:, : self.committed] = True
            for row, i in enumerate(chosen):
                self.tree[i].slot = offset + row
                a = self.tree[i].parent
                while a >= 0:
                    sees[row, self.tree[a].slot] = True
                    a = self.tree[a].parent
                sees[row, offset + row] = True
            features = torch.cat([outputs[self.tree[i].parent] if self.tree[i].parent >= 0 else root_out for i in chosen])
            tokens = torch.tensor([self.tree[i].token for i in chosen])
            out = self.head.grow(self.cache, features, self.local.embed(tokens), torch.full((n,), last + depth), sees)
            outputs.update(zip(chosen, out[:, None]))
            self._offer(chosen, out, depth + 1)

    def _drafts(self) -> list[Draft]:
        drafts = []
        for i, nd in enumerate(self.tree):
            path, a = [], i
            while a >= 0:
                path.append(self.tree[a].token)
                a = self.tree[a].parent
            drafts.append(Draft(tuple(reversed(path)), self.name, nd.q, nd.score))
        return drafts

    def _resolve(self, history: Sequence[int]) -> None:
        """Score the last tree's offers against the tokens committed since: every child of a node on
        the committed path is one trial of its probability bin."""
        siblings = [i for i, nd in enumerate(self.tree) if nd.parent < 0]
        for d in range(len(history) - self.tree_start):
            token = history[self.tree_start + d]
            for i in siblings:
                self.calibration.record(self.tree[i].bin, self.tree[i].token == token, 1)
            match = next((i for i in siblings if self.tree[i].token == token), None)
            if match is None:
                break
            siblings = self.tree[match].children
            if not siblings:
                break
