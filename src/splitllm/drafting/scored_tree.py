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

While a step is in flight, the proposer can `prepare` the next tree for the outcome it thinks likeliest
(`likely_path`): the tree after that path, one level deeper, whose first level stands for the bonus
token. A model that reads tokens alone (a draft model) reads the path into its cache first; one that
reads the target's features (the learned drafter), which the step has not returned yet, grows the tree
below the path's last node of the tree in flight, from its own guesses of those features, as it grows
any depth (`_Root`). If the step commits that path and a bonus among the first level, the next
`propose` takes the subtree under the bonus instead of drafting on the critical path (`_adopt`);
otherwise it drafts as usual, its cache keeping the common prefix (syncing crops the guesses).

Node scores are estimated acceptance chances: the product along the path of the drafting model's
probability, recalibrated per probability bin against the tokens actually committed. They depend only
on the committed history (and the target's features, for a drafter that reads them), never on the
sampler's draws, so greedy output stays sequential's and speculative sampling stays exact with the
candidates treated as point masses.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
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
    out: torch.Tensor | None = None  # the drafting model's output there (1, d), once expanded


@dataclass(frozen=True)
class _Root:
    """Where a tree hangs: the output that gives its first level, the position its depth-1 nodes take less
    one, and the cache entries besides the committed ones that its nodes see (a prepared tree's guessed path)."""

    out: torch.Tensor
    last: int
    context: tuple[int, ...] = ()


@dataclass
class _Prepared:
    """A tree drafted while a step was in flight, after `history` (the committed tokens and the path the
    step was expected to accept): its first level stands for the step's bonus token."""

    history: list[int]
    tree: list[_Node]
    root: _Root


class ScoredTreeProposer(ABC):
    """A `TreeDrafter`: a Proposer whose candidates are single scored nodes of a tree (see `Candidate.score`).

    Subclasses say how the drafting model catches up with the committed sequence (`_sync`), runs a
    depth of nodes (`_expand`) and turns outputs into token probabilities (`_top`).
    """

    name = "draft"
    taps: tuple[int, ...] = ()  # layers whose outputs `observe` needs beside the features
    reads_tokens = False  # whether it drafts from tokens alone (so it prepares after reading the path)

    def __init__(self, cache: KVCache, top_k: int, beam: int, calibration_config: CalibrationConfig) -> None:
        self.cache, self.top_k, self.beam = cache, top_k, beam
        self.bins = calibration_config.drafter_bins
        self.calibration: Calibration[int] = Calibration(calibration_config.prior_weight)  # P(right | bin of q)
        self.committed = 0  # cache entries holding committed positions
        self.tree: list[_Node] = []
        self.tree_start = 0  # history index of the tree's depth-1 tokens
        self.root: _Root | None = None  # where the tree hangs
        self.draft_ms = 0.0  # time spent drafting since the last take_draft_ms()
        self.pass_ms: float | None = None  # running average of one depth's pass (None: none timed yet)
        self.prepared: _Prepared | None = None
        self.sent: _Prepared | None = None  # the prepared tree, gone to the server as a step sent ahead
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
    def _expand(self, parents: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                sees: torch.Tensor) -> torch.Tensor:
        """Outputs of n nodes (their parents' outputs and their tokens) appended to the cache, each
        seeing the entries `sees` (n, cache length + n) marks."""

    @abstractmethod
    def _top(self, outputs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most likely next tokens after each output: probabilities and target token ids."""

    def catch_up(self, history: Sequence[int]) -> Iterator[object]:
        """Nothing to read beside a round trip unless it `reads_tokens`: a drafter over the target's
        features catches up as it next drafts."""
        return iter(())

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
                return self._candidates(self.tree)
            synced = self._sync(history)
            if synced is None:
                return []
            self.tree_start = len(history)
            self.root = _Root(*synced)
            self._grow(self.root, budget)
            return self._candidates(self.tree)
        finally:
            self.cache.keep(list(range(self.cache.pending)))  # so the next crop finds every entry committed
            self.draft_ms += (time.perf_counter() - t0) * 1000

    def prepare(self, history: Sequence[int], budget: SpecBudget, until: float) -> None:
        """Draft the tree after `history` (committed tokens plus the path the step in flight is expected
        to accept) one level deeper than `budget`, for the next `propose` to take if the step goes so;
        no depth is begun that would end after `until` (time.perf_counter()), when the step is expected
        back. Learns nothing (the step's outcome is not known yet); `prepared` holds the tree, if any."""
        if not budget.max_nodes or not budget.depth:
            return
        tree, start, root = self.tree, self.tree_start, self.root  # the tree in flight, which the next propose resolves
        try:
            if self.reads_tokens:
                synced = self._sync(history)
                below = None if synced is None else _Root(*synced)
            else:
                below = self._root_below(history[self.tree_start :])
            if below is None:
                return
            self.tree = []
            self._grow(below, replace(budget, depth=budget.depth + 1), until)
            self.prepared = _Prepared(list(history), self.tree, below)
        finally:
            self.cache.keep(list(range(self.cache.pending)))
            self.tree, self.tree_start, self.root = tree, start, root

    def _root_below(self, path: Sequence[int]) -> _Root | None:
        """Where a tree after `path` (tokens down the tree from its first level) hangs: below the path's
        last node, whose output is expanded now if it was not, every node seeing the path's entries;
        None if the tree does not hold the path or hangs nowhere yet."""
        if self.root is None:
            return None
        nodes, level = [], [i for i, nd in enumerate(self.tree) if nd.parent < 0]
        for token in path:
            node = next((i for i in level if self.tree[i].token == token), None)
            if node is None:
                return None
            nodes.append(node)
            level = self.tree[node].children
        if not nodes:
            return self.root
        end = self.tree[nodes[-1]]
        if end.out is None:
            if self.cache.length + self.cache.pending >= self.cache.max_context:
                return None
            self._run([nodes[-1]], self.root)
        assert end.out is not None
        return _Root(end.out, self.root.last + end.depth, (*self.root.context, *(self.tree[i].slot for i in nodes)))

    def send_prepared(self) -> list[Candidate]:
        """The prepared tree's nodes as candidates (its first level stands for the bonus token), for a
        step sent ahead now; it stays `sent` until that step is taken (`take_sent`) or dropped."""
        assert self.prepared is not None
        self.sent, self.prepared = self.prepared, None
        return self._candidates(self.sent.tree)

    def take_sent(self, history: Sequence[int]) -> None:
        """The step sent ahead goes on from here (`history` ends with its bonus token): the tree in flight
        learns what was committed, and the sent tree is the one the next steps resolve and prepare after."""
        assert self.sent is not None
        sent, self.sent = self.sent, None
        self._resolve(history)
        self.tree, self.tree_start, self.root = sent.tree, len(sent.history), sent.root
        self.adopted = True

    def drop_sent(self) -> None:
        """The step sent ahead was given up: its tree is forgotten, the tree in flight stays to be resolved."""
        self.sent = None

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
                score = nd.score / tree[root].score
                self.tree.append(_Node(nd.token, renumber[nd.parent], nd.depth - 1, nd.q, nd.bin, score, nd.slot,
                                       out=nd.out))
                if nd.parent != root:
                    self.tree[renumber[nd.parent]].children.append(renumber[i])
        self.tree_start = len(history)
        bonus = tree[root]
        assert bonus.out is not None  # it has children: it was expanded
        self.root = _Root(bonus.out, prepared.root.last + 1, (*prepared.root.context, bonus.slot))
        return True

    def likely_path(self, verified: Callable[[list[int]], bool], entered: bool = False) -> tuple[list[int], float]:
        """The tokens of the last tree the step verifying it likely accepts before a bonus token a tree
        prepared after them would offer, and the estimated chance that it accepts them all.

        Down the likeliest nodes the step holds (`verified(path)`), to where a prepared tree is likeliest
        to be taken: the chance of stopping there (a node's chance less its verified children's) times
        the chance that the bonus is among the tokens offered there but not verified (for a node not
        expanded yet, the share of the next token a level of offers usually holds). `entered`: the step
        is one sent ahead and taken up, which verifies below the first-level node it was taken up at:
        the path begins there, and its chance is counted from there."""
        offered = [sum(self.tree[c].q for c in nd.children) for nd in self.tree if nd.children]
        usual = sum(offered) / len(offered) if offered else 0.5

        def taken(children: list[int], path: list[int], stop: float) -> tuple[float, list[int]]:
            kids = [c for c in children if verified([*path, self.tree[c].token])]
            if not children:
                return stop * usual, kids
            inside = sum(self.tree[c].q for c in kids)
            outside = sum(self.tree[c].q for c in children) - inside
            return (stop - sum(self.tree[c].score for c in kids)) * outside / max(1.0 - inside, 1e-6), kids

        path: list[int] = []
        best_taken, kids = taken([i for i, nd in enumerate(self.tree) if nd.parent < 0], path, 1.0)
        best, best_score, given = path, 1.0, 1.0
        if entered and kids:
            entry = self.tree[kids[0]]
            path = best = [entry.token]
            best_taken, kids = taken(entry.children, path, entry.score)
            best_score = given = entry.score
        while kids:
            node = self.tree[max(kids, key=lambda i: self.tree[i].score)]
            path = [*path, node.token]
            chance, kids = taken(node.children, path, node.score)
            if chance > best_taken:
                best, best_taken, best_score = path, chance, node.score
        return best, best_score / given

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

    def _grow(self, root: _Root, budget: SpecBudget, until: float | None = None) -> None:
        """Grow the tree after the bonus token from `root`; no depth begins that would end after `until`
        (time.perf_counter(); None: no such bound)."""
        max_depth = min(budget.depth, self.max_position - root.last)
        # A node less likely than this is not worth verifying even first (see NodeCost): nor expanding.
        floor = budget.cost.node_ms / budget.cost.step_ms if budget.cost and budget.cost.step_ms > 0 else MIN_SCORE
        self._offer([-1], root.out, 1)
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
            t0 = time.perf_counter()
            self._offer(chosen, self._run(chosen, root), depth + 1)
            ms = (time.perf_counter() - t0) * 1000  # the pass and its children's probabilities
            self.pass_ms = ms if self.pass_ms is None else 0.8 * self.pass_ms + 0.2 * ms

    def _run(self, chosen: list[int], root: _Root) -> torch.Tensor:
        """One pass over nodes of one depth: each enters the cache seeing the committed entries, the
        root's context and its ancestors; their outputs (n, d), also kept on the nodes."""
        offset = self.cache.length + self.cache.pending
        n = len(chosen)
        sees = torch.zeros(n, offset + n, dtype=torch.bool)
        sees[:, : self.committed] = True
        sees[:, list(root.context)] = True
        for row, i in enumerate(chosen):
            self.tree[i].slot = offset + row
            a = self.tree[i].parent
            while a >= 0:
                sees[row, self.tree[a].slot] = True
                a = self.tree[a].parent
            sees[row, offset + row] = True
        parents = torch.cat([self._out(self.tree[i].parent, root) for i in chosen])
        tokens = torch.tensor([self.tree[i].token for i in chosen])
        out = self._expand(parents, tokens, torch.full((n,), root.last + self.tree[chosen[0]].depth), sees)
        for row, i in enumerate(chosen):
            self.tree[i].out = out[row : row + 1]
        return out

    def _out(self, node: int, root: _Root) -> torch.Tensor:
        out = root.out if node < 0 else self.tree[node].out
        assert out is not None  # a parent is expanded before its children
        return out

    def _pays(self, chosen: list[int], cost: NodeCost) -> bool:
        """Whether a pass over the `chosen` nodes can be worth its time: their children add at most the
        chosen nodes' chances in expected tokens, each worth the step's time per expected token."""
        if self.pass_ms is None:
            return True
        expected = 1.0 + sum(nd.score for nd in self.tree)
        ms = cost.step_ms + cost.node_ms * len(self.tree)
        return sum(self.tree[i].score for i in chosen) * ms / expected > self.pass_ms

    def _candidates(self, tree: list[_Node]) -> list[Candidate]:
        candidates = []
        for i, nd in enumerate(tree):
            path, a = [], i
            while a >= 0:
                path.append(tree[a].token)
                a = tree[a].parent
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
