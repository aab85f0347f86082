"""Attacks at every split depth: the measurement primitives and the input- and output-side sweeps.

The attacker is an honest-but-curious server holding the public weights. It trains its learned
attacks on states it computes itself from text it has (here: the corpus's training documents), and
is scored on held-out documents. The one thing it never has is the client's token ids.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from splitllm.model.stage import Stage, Step
from splitllm.weights.sources import ModelFiles
from splitllm.lab import rates
from splitllm.lab.privacy import defenses
from splitllm.lab.privacy.attacks.learned import Attacker, recovery, top_k
from splitllm.lab.privacy.attacks.mlp import mlp_attacker
from splitllm.lab.privacy.attacks.output_probe import whitebox_next_tokens
from splitllm.lab.privacy.attacks.sequence import sequence_attacker
from splitllm.lab.privacy.attacks.whitebox import WIRE_TOLERANCE, LanguageModelPrior, invert
from splitllm.lab.privacy.audit_config import AuditConfig
from splitllm.lab.data.corpus import KINDS, Corpus
from splitllm.lab.privacy.states import WIRE_DTYPE, PublicModel, WindowStates
from splitllm.model.visibility import Visibility

log = logging.getLogger("splitllm.lab.privacy")


@dataclass
class Context:
    """One audit's inputs: the public model, the corpus and its states at every cut, timings so far."""

    cfg: AuditConfig
    files: ModelFiles
    corpus: Corpus
    model: PublicModel
    train: WindowStates
    test: WindowStates
    long: WindowStates | None = None  # whole long test contexts (input side only)
    timings: dict[str, float] = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)

    @property
    def n_layers(self) -> int:
        return self.files.config.num_layers

    def spread_windows(self, k: int) -> list[int]:
        """k test windows spread over the set, so both prose and code are covered."""
        n = self.corpus.test.shape[0]
        return sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(min(k, n))})


def flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def by_kind(ctx: Context, predicted: torch.Tensor, labels: torch.Tensor) -> dict[str, dict]:
    """Top-1 rate per kind of test text; predicted: (n_test, window, k)."""
    return {
        kind: recovery(predicted, labels, ctx.corpus.test_kind_mask(kind))[0]
        for kind in KINDS
        if kind in ctx.corpus.test_kinds
    }


def learned_attacks(
    ctx: Context,
    cut: int,
    train_states: torch.Tensor,
    test_states: torch.Tensor,
    labels: tuple[torch.Tensor, torch.Tensor],
    table: torch.Tensor,
    sequence: bool,
) -> tuple[dict, Attacker]:
    """Train the per-position attacker (and the sequence one on top) and score them on the test set."""
    cfg = ctx.cfg
    train_labels, test_labels = labels
    mlp = mlp_attacker(flat(train_states), train_labels.flatten(), table, epochs=cfg.mlp_epochs, seed=cfg.seed + cut)
    predicted = top_k(mlp, flat(test_states)).view(*test_states.shape[:2], -1)
    top1, top5 = recovery(predicted, test_labels)
    out = {"mlp_top1": top1, "mlp_top5": top5, "mlp_top1_by_kind": by_kind(ctx, predicted, test_labels)}
    if sequence:
        seq = sequence_attacker(train_states, train_labels, mlp, epochs=cfg.sequence_epochs, seed=cfg.seed + cut)
        out["sequence_top1"] = recovery(top_k(seq, test_states, batch=4), test_labels)[0]
    return out, mlp


def small_mlp(ctx: Context, first: int) -> dict:
    """The per-position attacker trained on as few pairs as the published design, evenly spread."""
    cfg = ctx.cfg
    states, labels = flat(ctx.train.states[first]), ctx.corpus.train.flatten()
    pick = torch.linspace(0, len(labels) - 1, cfg.small_train_pairs).long()
    epochs = cfg.mlp_epochs * max(1, len(labels) // cfg.small_train_pairs)  # the same number of steps
    mlp = mlp_attacker(states[pick], labels[pick], ctx.model.embed, epochs=epochs, seed=cfg.seed + first)
    return recovery(top_k(mlp, flat(ctx.test.states[first])), ctx.corpus.test.flatten())[0]


Target = tuple[torch.Tensor, list[int], str]  # (P, d) wire states, their true tokens, the kind of text


def whitebox_targets(ctx: Context, states: torch.Tensor, first: int | None = None) -> list[Target]:
    """What the white-box search inverts. Undefended (`first` given): whole test windows spread over
    the kinds plus the long contexts; defended: the first positions of fewer windows (searches there
    run to the candidate cap, so they are kept short)."""
    cfg, corpus = ctx.cfg, ctx.corpus
    if first is None:
        picks, length = ctx.spread_windows(cfg.defense_whitebox_windows), cfg.defense_whitebox_positions
    else:
        picks, length = ctx.spread_windows(cfg.whitebox_windows), corpus.test.shape[1]
    out = [(states[w, :length], corpus.test[w, :length].tolist(), corpus.test_kinds[w]) for w in picks]
    if first is not None and ctx.long is not None:
        out += [(ctx.long.states[first][i], corpus.long[i].tolist(), k) for i, k in enumerate(corpus.long_kinds)]
    return out


def whitebox_attack(
    ctx: Context,
    first: int,
    targets: list[Target],
    proposer: Attacker,
    tolerance: float = WIRE_TOLERANCE,
    certify: bool = True,
    exhaustive: int = 0,
) -> dict:
    """Invert each target left to right with the public layers [0, `first`); rates per position. The
    first `exhaustive` positions of the first target are searched over the whole vocabulary."""
    cfg, model = ctx.cfg, ctx.model
    stack = model.stack.upto(first)
    hits, certified, kinds, positions = [], [], [], []
    seconds, tried, collisions, searched_all = 0.0, 0, 0, 0
    checks = set(range(exhaustive))
    for states, truth, kind in targets:
        prior = LanguageModelPrior(model, len(states) + 1)
        with torch.inference_mode():
            learned = proposer.scorer.vocab_logits(proposer(states))

        def proposals(
            t: int, recovered: list[int], learned: torch.Tensor = learned, prior: LanguageModelPrior = prior
        ) -> list[torch.Tensor]:
            scores = [learned[t]]
            if t > 0:
                scores.append(prior.extend(recovered[-1], t - 1))
            return scores

        inv = invert(
            stack,
            model.embed,
            states,
            proposals,
            tolerance,
            max_candidates=cfg.whitebox_max_candidates,
            certify=certify,
            exhaustive=checks,
        )
        checks = set()  # the whole-vocabulary check runs on the first target's first positions
        hits += [a == b for a, b in zip(inv.tokens, truth)]
        certified += inv.certified
        kinds += [kind] * len(truth)
        positions += list(range(len(truth)))
        seconds += inv.seconds
        tried += sum(inv.candidates)
        collisions += sum(inv.collisions)
        searched_all += sum(inv.exhaustive)
    hit, n = torch.tensor(hits), len(hits)
    out = {
        "whitebox_recovery": rates.of(hit),
        "whitebox_certified": rates.of(torch.tensor(certified)),
        "whitebox_seconds_per_token": seconds / n,
        "whitebox_candidates_per_token": tried / n,
        "whitebox_collisions": collisions,
        "whitebox_exhaustive_positions": searched_all,
        "whitebox_by_kind": {k: rates.of(hit[torch.tensor([x == k for x in kinds])]) for k in KINDS if k in kinds},
    }
    late = torch.tensor(positions) >= 256
    if late.any():
        out["whitebox_past_256"] = rates.of(hit[late])
    return out


def first_ms(ctx: Context, first: int) -> float:
    return defenses.step_ms(ctx.model.stack.upto(first), lambda ids: ctx.model.embed[ids], lambda h: h)


def last_ms(ctx: Context, last: int) -> float:
    n = ctx.n_layers
    stack = ctx.model.stack.between(n - last, n)
    return defenses.step_ms(stack, lambda ids: ctx.model.embed[ids], ctx.model.logits)


def input_side(ctx: Context) -> tuple[list[dict], dict[int, Attacker]]:
    """One row per first-stage depth K; also returns each depth's trained MLP (the defenses reuse it)."""
    rows, attackers = [], {}
    labels = (ctx.corpus.train, ctx.corpus.test)
    for k in ctx.cfg.first_depths:
        t0 = time.perf_counter()
        row: dict = {"K": k, "client_ms_per_step": first_ms(ctx, k)}
        learned, mlp = learned_attacks(
            ctx, k, ctx.train.states[k], ctx.test.states[k], labels, ctx.model.embed, sequence=True
        )
        row.update(learned)
        row["mlp_small_top1"] = small_mlp(ctx, k)
        targets = whitebox_targets(ctx, ctx.test.states[k], k)
        row.update(whitebox_attack(ctx, k, targets, mlp, exhaustive=ctx.cfg.whitebox_exhaustive_positions))
        attackers[k] = mlp
        rows.append(row)
        ctx.timings[f"input_K{k}"] = time.perf_counter() - t0
        log.info("input side K=%d: %s", k, fmt(row))
    return rows, attackers


def output_side(ctx: Context) -> list[dict]:
    """One row per last-stage depth M: learned probe and public-last-stage predictions of the next token."""
    rows, n = [], ctx.n_layers
    table = ctx.model.client_model.lm_head.weight
    labels = (ctx.train.greedy, ctx.test.greedy)
    for m in ctx.cfg.last_depths:
        t0 = time.perf_counter()
        cut = n - m
        row: dict = {"M": m, "client_ms_per_step": last_ms(ctx, m)}
        learned, _ = learned_attacks(
            ctx, cut, ctx.train.states[cut], ctx.test.states[cut], labels, table, sequence=False
        )
        row["probe_top1"], row["probe_top5"] = learned["mlp_top1"], learned["mlp_top5"]
        predicted = whitebox_next_tokens(ctx.model, ctx.model.stack.between(cut, n), ctx.test.states[cut])
        row["whitebox_agreement"] = rates.of(predicted == ctx.test.greedy)
        rows.append(row)
        ctx.timings[f"output_M{m}"] = time.perf_counter() - t0
        log.info("output side M=%d: %s", m, fmt(row))
    return rows


@torch.inference_mode()
def first_stage_states(stage: Stage, embed: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    """Wire states of windows through a (defended) client first stage."""
    n, length = windows.shape
    out = torch.empty(n, length, stage.cfg.hidden_size, dtype=WIRE_DTYPE)
    for i in range(n):
        h = stage(stage.new_cache(length), Step(embed[windows[i]], torch.arange(length), Visibility.chain(length)))
        out[i] = h.to(WIRE_DTYPE)
    return out


def fmt(row: dict) -> str:
    def one(v: object) -> str:
        if isinstance(v, dict) and "rate" in v:
            return f"{v['rate']:.3g}"
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    return ", ".join(f"{k}={one(v)}" for k, v in row.items() if not (isinstance(v, dict) and "rate" not in v))
