"""Leakage and cost of each defense at one split: noise, a secret rotation, a secret low-rank change.

Every defended run is compared with the undefended split on held-out text, teacher-forced: perplexity,
KL to the undefended next-token distribution, and how often the most likely next token is unchanged.
Attackers are as strong as the defense allows: they know the noise model, train on noised states,
and (for the private-weights defenses) are scored both with public weights only and with what a
server can learn (the rotation's key from its own weights; a map fitted on known plaintext).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from splitllm.client.client_model import ClientModel
from splitllm.client.pipeline import InProcessMiddle, SplitPipeline
from splitllm.model.stage import Stage, Step
from splitllm.lab import heldout
from splitllm.lab import rates
from splitllm.lab.privacy import defenses
from splitllm.lab.privacy.attacks.learned import Attacker, recovery, top_k
from splitllm.lab.privacy.attacks.map_beam import map_beam
from splitllm.lab.privacy.attacks.output_probe import whitebox_next_tokens
from splitllm.lab.privacy.attacks.whitebox import WIRE_TOLERANCE
from splitllm.lab.privacy.states import WIRE_DTYPE
from splitllm.lab.privacy.depth_sweep import (
    Context,
    Target,
    flat,
    fmt,
    first_stage_states,
    learned_attacks,
    log,
    whitebox_attack,
    whitebox_targets,
)
from splitllm.model.visibility import Visibility


class Quality:
    """Output quality of the split model at the defense split, against the undefended run."""

    def __init__(self, ctx: Context) -> None:
        cfg = ctx.cfg
        self.client_model = ClientModel(ctx.files, cfg.defense_first, cfg.defense_last)
        n = ctx.n_layers
        self.middle = Stage.load(ctx.files, cfg.defense_first, n - cfg.defense_last, torch.float32)
        self.windows = ctx.corpus.test[ctx.spread_windows(cfg.perplexity_windows)]
        self.reference = heldout.log_probs(self.client_model, self.plain(), self.windows)
        self.base = heldout.quality(self.windows, self.reference, self.reference)

    def plain(self, middle: Stage | None = None) -> Callable[[], InProcessMiddle]:
        stage = middle or self.middle
        return lambda: InProcessMiddle(stage, self.windows.shape[1])

    def measure(self, client_model: ClientModel, middle: Callable) -> dict:
        return heldout.quality(self.windows, self.reference, heldout.log_probs(client_model, middle, self.windows))


def map_attack(ctx: Context, targets: list[Target], proposer: Attacker, noise: defenses.GaussianNoise) -> dict:
    """MAP decoding of the noised white-box targets, with the white-box search's candidate cap: by
    the likelihood alone (one hypothesis: the most likely token at each position given the
    recovered prefix) and with the LM prior and a beam."""
    cfg, k = ctx.cfg, ctx.cfg.defense_first
    cap = cfg.whitebox_max_candidates or ctx.files.config.vocab_size
    hits: dict[str, list[bool]] = {"map_likelihood": [], "map_beam": []}
    seconds = 0.0
    for states, truth, _ in targets:
        with torch.inference_mode():
            learned = proposer.scorer.vocab_logits(proposer(states))
        for key, beam, prior in (("map_likelihood", 1, False), ("map_beam", cfg.map_beam_width, True)):
            out = map_beam(ctx.model, k, states, noise, learned, beam, prior, max_candidates=cap)
            hits[key] += [a == b for a, b in zip(out.tokens, truth)]
            seconds += out.seconds if prior else 0.0
    result: dict = {key: rates.of(torch.tensor(h)) for key, h in hits.items()}
    result["map_beam_seconds_per_token"] = seconds / len(hits["map_beam"])
    return result


def noise_row(
    ctx: Context, quality: Quality, noise: defenses.GaussianNoise, row: dict, tolerance: float, seed: int
) -> dict:
    """Attackers that know the noise and train on noised states, and the noise's cost."""
    k, labels = ctx.cfg.defense_first, (ctx.corpus.train, ctx.corpus.test)
    gen = torch.Generator().manual_seed(seed)
    train, test = noise(ctx.train.states[k], gen), noise(ctx.test.states[k], gen)
    learned, mlp = learned_attacks(ctx, k, train, test, labels, ctx.model.embed, sequence=True)
    row.update(learned)
    targets = whitebox_targets(ctx, test)
    row.update(whitebox_attack(ctx, k, targets, mlp, tolerance=tolerance, certify=False))
    row.update(map_attack(ctx, targets, mlp, noise))
    row.update(quality.measure(quality.client_model, lambda: defenses.NoisyMiddle(quality.plain()(), noise, seed)))
    log.info("noise %s", fmt(row))
    return row


def noise_defenses(ctx: Context, quality: Quality) -> tuple[list[dict], list[dict]]:
    """The rows of relative noise (per sigma) and of DP noise (per epsilon)."""
    cfg, k = ctx.cfg, ctx.cfg.defense_first
    relative = [
        noise_row(
            ctx,
            quality,
            defenses.RelativeNoise(sigma),
            {"sigma": sigma},
            WIRE_TOLERANCE + 1.25 * sigma,
            cfg.seed + 100 + i,
        )
        for i, sigma in enumerate(cfg.noise_sigmas)
    ]
    clip = float(flat(ctx.train.states[k]).float().norm(dim=-1).median())
    dp_rows = []
    for i, epsilon in enumerate(cfg.dp_epsilons):
        dp = defenses.DPNoise(clip, epsilon, cfg.dp_delta)
        row = {"epsilon": epsilon, "delta": cfg.dp_delta, "clip": clip, "sigma": dp.sigma}
        dp_rows.append(noise_row(ctx, quality, dp, row, WIRE_TOLERANCE, cfg.seed + 200 + i))
    return relative, dp_rows


def defense_sweep(ctx: Context, attackers: dict[int, Attacker]) -> dict:
    """Every defense at the defense split; `attackers`: MLPs trained on public states, by first-stage depth."""
    cfg, k = ctx.cfg, ctx.cfg.defense_first
    t0 = time.perf_counter()
    quality = Quality(ctx)
    labels = (ctx.corpus.train, ctx.corpus.test)
    public_mlp = (
        attackers.get(k)
        or learned_attacks(ctx, k, ctx.train.states[k], ctx.test.states[k], labels, ctx.model.embed, sequence=False)[1]
    )
    out: dict = {
        "split": {"first": k, "last": cfg.defense_last},
        "undefended": {"perplexity": quality.base["perplexity"]},
        "quality_positions": int(quality.windows.numel()),
    }
    out["noise"], out["dp_noise"] = noise_defenses(ctx, quality)
    out["rotation"] = rotation(ctx, quality, public_mlp)
    out["lowrank"] = lowrank(ctx, quality, public_mlp)
    ctx.timings["defenses"] = time.perf_counter() - t0
    return out


def _prefixed(prefix: str, row: dict) -> dict:
    return {f"{prefix}_{key}": v for key, v in row.items() if key != "whitebox_by_kind"}


def rotation(ctx: Context, quality: Quality, public_mlp: Attacker) -> dict:
    """A secret rotation: leakage without the key, the key's recovery, leakage with it, and the cost."""
    cfg, k = ctx.cfg, ctx.cfg.defense_first
    q = defenses.random_rotation(ctx.files.config.hidden_size, cfg.seed + 7)
    client_model = defenses.rotate_client_model(quality.client_model, q)
    middle = defenses.rotate_stage(quality.middle, q)
    test = first_stage_states(client_model.first, client_model.input_table(), ctx.corpus.test)
    labels = ctx.corpus.test.flatten()
    row: dict = {"public_weights_mlp_top1": recovery(top_k(public_mlp, flat(test)), labels)[0]}
    targets = whitebox_targets(ctx, test)
    row.update(_prefixed("public_weights", whitebox_attack(ctx, k, targets, public_mlp, certify=False)))
    q_weights = defenses.rotation_from_weights(quality.middle, middle)
    # Known plaintext: sessions whose text the server learns; it computes their public states itself.
    plain, seen = (flat(x)[: cfg.known_pairs].float() for x in (ctx.test.states[k], test))
    q_pairs = defenses.procrustes(plain, seen)
    row["key_error_from_server_weights"] = float((q_weights - q).norm() / q.norm())
    row["key_error_from_known_pairs"] = float((q_pairs - q).norm() / q.norm())
    row["known_pairs"] = len(plain)
    recovered = (test.float() @ q_weights.T).to(WIRE_DTYPE)
    row["recovered_key_mlp_top1"] = recovery(top_k(public_mlp, flat(recovered)), labels)[0]
    # With the key the states are the undefended ones again: the certified search applies.
    targets = whitebox_targets(ctx, recovered)
    row.update(_prefixed("recovered_key", whitebox_attack(ctx, k, targets, public_mlp)))
    row.update(quality.measure(client_model, quality.plain(middle)))
    log.info("rotation: %s", fmt(row))
    return row


def lowrank(ctx: Context, quality: Quality, public_mlp: Attacker) -> list[dict]:
    """Secret low-rank changes of the client's layers, per scale: input and output leakage, and cost.

    Adaptive attacker: with known plaintext it fits a linear map from the defended states back to the
    public ones (least squares on `known_pairs` pairs) and runs its public-weight attacks through it.
    """
    cfg, k, n = ctx.cfg, ctx.cfg.defense_first, ctx.n_layers
    rows = []
    labels = (ctx.corpus.train, ctx.corpus.test)
    for i, scale in enumerate(cfg.lowrank_scales):
        client_model = defenses.perturb_client_model(quality.client_model, cfg.seed + 1000 + i, cfg.lowrank_rank, scale)
        train = first_stage_states(client_model.first, client_model.input_table(), ctx.corpus.train)
        test = first_stage_states(client_model.first, client_model.input_table(), ctx.corpus.test)
        row: dict = {"scale": scale, "rank": cfg.lowrank_rank}
        row["public_weights_mlp_top1"] = recovery(top_k(public_mlp, flat(test)), labels[1].flatten())[0]
        targets = whitebox_targets(ctx, test)
        row.update(_prefixed("public_weights", whitebox_attack(ctx, k, targets, public_mlp, certify=False)))
        learned, _ = learned_attacks(ctx, k, train, test, labels, ctx.model.embed, sequence=False)
        row["known_plaintext_mlp_top1"] = learned["mlp_top1"]
        back = defenses.linear_map(flat(train)[: cfg.known_pairs], flat(ctx.train.states[k])[: cfg.known_pairs])
        mapped = (test.float() @ back).to(WIRE_DTYPE)
        row["fitted_map_mlp_top1"] = recovery(top_k(public_mlp, flat(mapped)), labels[1].flatten())[0]
        mapped_wb = whitebox_attack(ctx, k, whitebox_targets(ctx, mapped), public_mlp, certify=False)
        row.update(_prefixed("fitted_map", mapped_wb))
        # Output side: the server runs the public last stage on what it returns; the client's is private.
        windows = quality.windows
        client_next = client_next_tokens(client_model, quality.middle, windows)
        returned = middle_out(client_model, quality.middle, windows)
        public_next = whitebox_next_tokens(ctx.model, ctx.model.stack.between(n - cfg.defense_last, n), returned)
        row["output_whitebox_agreement"] = rates.of(public_next == client_next)
        row.update(quality.measure(client_model, quality.plain()))
        rows.append(row)
        log.info("low-rank scale=%g: %s", scale, fmt(row))
    return rows


@torch.inference_mode()
def middle_out(client_model: ClientModel, middle: Stage, windows: torch.Tensor) -> torch.Tensor:
    """What the server computes and returns for each window under a private first stage."""
    sent = first_stage_states(client_model.first, client_model.input_table(), windows)
    length = windows.shape[1]
    out = torch.empty_like(sent)
    for i, h in enumerate(sent):
        out[i] = middle(middle.new_cache(length),
                        Step(h.float(), torch.arange(length), Visibility.chain(length))).to(WIRE_DTYPE)
    return out


@torch.inference_mode()
def client_next_tokens(client_model: ClientModel, middle: Stage, windows: torch.Tensor) -> torch.Tensor:
    """The tokens the (defended) client would generate next at every position of each window."""
    length = windows.shape[1]
    out = torch.empty(windows.shape, dtype=torch.long)
    for i, tokens in enumerate(windows):
        pipeline = SplitPipeline(client_model, InProcessMiddle(middle, length), length)
        out[i] = pipeline.score(Step(tokens, torch.arange(length), Visibility.chain(length)))[0].argmax(-1)
    return out
