"""A token tree grown EAGLE-2 style by a model that drafts on the client, its nodes scored by calibrated chance.

The drafting model keeps a cache that mirrors the committed sequence. Each `propose` that drafts first
catches that cache up with what was committed since (`_sync`, after dropping the previous tree's
speculative entries; steps that do not draft leave the catching up waiting, so they cost nothing;
a draft model reads a prefill beside its round trip), whose last output gives the tree's first
level. Each later depth runs the best `beam` frontier nodes at once (each sees the committed entries
and its own ancestors) and offers every one's `top_k` tokens.
Where a link cost prices the step, a depth is run only while it can pay for its pass: its children can
add at most the chances of the nodes it runs in expected tokens, each worth what a token costs at this
link, against the measured time of one pass (a few milliseconds for a one-layer drafter, one whole
forward for a draft model).

While a step is in flight, a proposer that reads tokens alone (a draft model) can `prepare` the next
tree for the outcome it thinks likeliest (`likely_path`): the tree after that path, one level deeper,
whose first level stands for the bonus token. If the step commits that path and a bonus among the
first level, the next `propose` takes the subtree under the bonus instead of drafting on the
critical path (`_adopt`); otherwise it drafts as usual, its cache keeping the common prefix.

Node scores are estimated acceptance chances: the product along the path of the drafting model's
probability, recalibrated per probability bin against the tokens actually committed. They depend only
on the committed history (and the target's features, for a drafter that reads them), never on the
sampler's draws, so greedy output stays sequential's and speculative sampling stays exact with the
candidates treated as point masses.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from splitllm.decoding.sizing.budget import NodeCost, SpecBudget
from splitllm.decoding.sizing.calibration import Calibration, CalibrationConfig
from splitllm.decoding.proposers import Candidate
from splitllm.model.kv import KVCache

MIN_SCORE = 0.01  # nodes less likely than this are not expanded when no link cost says otherwise


def chain_after(committed: int, n: int) -> torch.Tensor:
    """The visibility (n, committed + n) of n committed tokens appended in order after `committed`
    entries: every earlier entry and each other causally (what `_sync` feeds, unlike a tree's nodes)."""
    return torch.cat([torch.ones(n, committed, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], 1)


@dataclass
class _Node:
    token: int
    parent: int  # index into the tree's nodes, -1: the root (the bonus token)
    depth: int
    q: float  # the drafting model's probability of this token given its parent
    bin: int  # q's calibration bin
    score: float  # estimated chance that the whole path is accepted
    slot: int = -1  # its cache entry, once expanded
    children: list[int] = field(default_factory=list)


@dataclass
class _Prepared:
    """A tree drafted while a step was in flight, after `history` (the committed tokens and the path the
    step was expected to accept): its first level stands for the step's bonus token."""

    history: list[int]
    tree: list[_Node]


class ScoredTreeProposer(ABC):
    """A Proposer whose candidates are single scored nodes of a tree (see `Candidate.score`).

    Subclasses say how the drafting model catches up with the committed sequence (`_sync`), runs a
    depth of nodes (`_expand`) and turns outputs into token probabilities (`_top`).
    """

    name = "draft"
    taps: tuple[int, ...] = ()  # layers whose outputs `observe` needs beside the features
    prepares = False  # whether it drafts from tokens alone, so it can `prepare` while a step is in flight

    def __init__(self, cache: KVCache, top_k: int, beam: int, calibration_config: CalibrationConfig) -> None:
        self.cache, self.top_k, self.beam = cache, top_k, beam
        self.bins = calibration_config.drafter_bins
        self.calibration: Calibration[int] = Calibration(calibration_config.prior_weight)  # P(right | bin of q)
        self.committed = 0  # cache entries holding committed positions
        self.tree: list[_Node] = []
        self.tree_start = 0  # history index of the tree's depth-1 tokens
        self.draft_ms = 0.0  # time spent drafting since the last take_draft_ms()
        self.pass_ms: float | None = None  # running average of one depth's pass (None: none timed yet)
        self.prepared: _Prepared | None = None
        self.adopted = False  # whether the last propose took the prepared tree

    @abstractmethod
    def observe(self, start: int, features: torch.Tensor, taps: torch.Tensor | None = None) -> None:
        """The target's features (last-stage outputs) at newly committed fed positions start, start + 1, ...,
        and the tapped layers' outputs there when `taps` names some."""

    @property
    @abstractmethod
    def max_position(self) -> int:
        """The drafting model's first position out of reach."""

    @abstractmethod
    def _sync(self, history: Sequence[int]) -> tuple[torch.Tensor, int] | None:
        """Catch the cache up with `history`: the output that predicts the token after the last one, and
        the position at which depth-1 nodes enter the cache, less one; None when it cannot draft yet."""

    @abstractmethod
    def _expand(self, parents: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, sees: torch.Tensor) -> torch.Tensor:
        """Outputs of n nodes (their parents' outputs and their tokens) appended to the cache, each
        seeing the entries `sees` (n, cache length + n) marks."""

    @abstractmethod
    def _top(self, outputs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most likely next tokens after each output: probabilities and target token ids."""

    def take_draft_ms(self) -> float:
        ms, self.draft_ms = self.draft_ms, 0.0
        return ms

    def propose(self, history: Sequence[int], budget: SpecBudget) -> list[Candidate]:
        t0 = time.perf_counter()
        prepared, self.prepared = self.prepared, None
        self.adopted = False
        try:
            self._resolve(history)
            self.tree = []
            if not budget.max_nodes or not budget.depth:
                return []  # the committed positions wait: the next drafting step syncs them in one pass
            self.adopted = prepared is not None and self._adopt(prepared, history)
            if self.adopted:
                return self._candidates()
            synced = self._sync(history)
            if synced is None:
                return []
            self.tree_start = len(history)
            self._grow(*synced, budget)
            return self._candidates()
        finally:
            self.cache.keep(list(range(self.cache.pending)))  # so the next crop finds every entry committed
            self.draft_ms += (time.perf_counter() - t0) * 1000

    def prepare(self, history: Sequence[int], budget: SpecBudget, until: float) -> None:
        """Draft the tree after `history` (committed tokens plus the path the step in flight is expected
        to accept) one level deeper than `budget`, for the next `propose` to take if the step goes so;
        no depth is begun that would end after `until` (time.perf_counter()), when the step is expected
        back. Learns nothing (the step's outcome is not known yet); `prepared` holds the tree, if any."""
        if not self.prepares or not budget.max_nodes or not budget.depth:
            return
        tree, start = self.tree, self.tree_start  # the tree in flight, which the next propose resolves
        try:
            synced = self._sync(history)
            if synced is None:
                return
            self.tree = []
            self._grow(*synced, replace(budget, depth=budget.depth + 1), until)
            self.prepared = _Prepared(list(history), self.tree)
        finally:
            self.cache.keep(list(range(self.cache.pending)))
            self.tree, self.tree_start = tree, start

    def _adopt(self, prepared: _Prepared, history: Sequence[int]) -> bool:
        """Take the prepared tree's subtree under the bonus token, if `history` is what it was prepared for
        plus a bonus on its first level: depths one less, scores given the bonus."""
        n = len(prepared.history)
        if len(history) != n + 1 or list(history[:n]) != prepared.history:
            return False
        tree = prepared.tree
        root = next((i for i, nd in enumerate(tree) if nd.parent < 0 and nd.token == history[-1]), None)
        if root is None or not tree[root].children:
            return False
        renumber = {root: -1}
        for i, nd in enumerate(tree):  # parents come first
            if nd.parent in renumber:
                renumber[i] = len(self.tree)
                self.tree.append(_Node(nd.token, renumber[nd.parent], nd.depth - 1, nd.q, nd.bin, nd.score / tree[root].score))
                if nd.parent != root:
                    self.tree[renumber[nd.parent]].children.append(renumber[i])
        self.tree_start = len(history)
        return True

    def likely_path(self, verified: Callable[[list[int]], bool]) -> list[int]:
        """The tokens of the last tree the step verifying it most likely accepts before its bonus token:
        down the likeliest nodes the step holds (`verified(path)`), to where stopping is likeliest (a
        node's chance less its verified children's)."""
        best: list[int] = []
        path: list[int] = []
        level = [i for i, nd in enumerate(self.tree) if nd.parent < 0]
        kids = [i for i in level if verified([self.tree[i].token])]
        best_stop = 1.0 - sum(self.tree[i].score for i in kids)
        while kids:
            node = self.tree[max(kids, key=lambda i: self.tree[i].score)]
            path = [*path, node.token]
            kids = [i for i in node.children if verified([*path, self.tree[i].token])]
            stop = node.score - sum(self.tree[i].score for i in kids)
            if stop > best_stop:
                best, best_stop = path, stop
        return best

    def _offer(self, parents: list[int], outputs: torch.Tensor, depth: int) -> None:
        """Add the top_k children of each parent (-1: root), given its output."""
        q, ids = self._top(outputs, self.top_k)
        bins = (q * self.bins).long().clamp_(0, self.bins - 1)
        # Plain lists from here: a tree's few dozen offers cost microseconds, not a tensor read each.
        for parent, tokens, probs, prob_bins in zip(parents, ids.tolist(), q.tolist(), bins.tolist()):
            base = 1.0 if parent < 0 else self.tree[parent].score
            for token, p, b in zip(tokens, probs, prob_bins):
                score = base * min(max(self.calibration.rate(b, p), 1e-4), 0.99)
                self.tree.append(_Node(token, parent, depth, p, b, score))
                if parent >= 0:
                    self.tree[parent].children.append(len(self.tree) - 1)

    def _grow(self, root_out: torch.Tensor, last: int, budget: SpecBudget, until: float | None = None) -> None:
        """Grow the tree after the bonus token; depth-d nodes enter the cache at position `last` + d; no
        depth begins that would end after `until` (time.perf_counter(); None: no such bound)."""
        max_depth = min(budget.depth, self.max_position - last)
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
            if budget.cost is not None and not self._pays(chosen, budget.cost):
                return
            if until is not None and time.perf_counter() + (self.pass_ms or 0.0) / 1000 > until:
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
            parents = torch.cat([outputs[self.tree[i].parent] if self.tree[i].parent >= 0 else root_out for i in chosen])
            tokens = torch.tensor([self.tree[i].token for i in chosen])
            t0 = time.perf_counter()
            out = self._expand(parents, tokens, torch.full((n,), last + depth), sees)
            outputs.update(zip(chosen, out[:, None]))
            self._offer(chosen, out, depth + 1)
            ms = (time.perf_counter() - t0) * 1000  # the pass and its children's probabilities
            self.pass_ms = ms if self.pass_ms is None else 0.8 * self.pass_ms + 0.2 * ms

    def _pays(self, chosen: list[int], cost: NodeCost) -> bool:
        """Whether a pass over the `chosen` nodes can be worth its time: their children add at most the
        chosen nodes' chances in expected tokens, each worth the step's time per expected token."""
        if self.pass_ms is None:
            return True
        expected = 1.0 + sum(nd.score for nd in self.tree)
        ms = cost.step_ms + cost.node_ms * len(self.tree)
        return sum(self.tree[i].score for i in chosen) * ms / expected > self.pass_ms

    def _candidates(self) -> list[Candidate]:
        candidates = []
        for i, nd in enumerate(self.tree):
            path, a = [], i
            while a >= 0:
                path.append(self.tree[a].token)
                a = self.tree[a].parent
            candidates.append(Candidate(tuple(reversed(path)), self.name, nd.q, nd.score))
        return candidates

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
