"""Leakage and cost of each defense at one split: noise, a secret rotation, a secret low-rank change.

Every defended run is compared with the undefended split on held-out perplexity and greedy output.
Attackers are as strong as the defense allows: they know the noise level, train on noisy states,
and (for the private-weights defenses) are scored both with public weights only and with what a
server can learn (the rotation's key from its own weights, plaintext pairs).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from splitllm.client.local import LocalModel
from splitllm.client.pipeline import LocalMiddle, SplitPipeline
from splitllm.model.stage import Stage
from splitllm.privacy import defenses
from splitllm.privacy.attacks.learned import Attacker, recovery, top_k
from splitllm.privacy.attacks.output_probe import whitebox_next_tokens
from splitllm.privacy.attacks.whitebox import WIRE_TOLERANCE
from splitllm.privacy.states import WIRE_DTYPE
from splitllm.privacy.sweep import Context, flat, fmt, head_states, learned_attacks, log, whitebox_attack
from splitllm.visibility import Visibility


class Quality:
    """Output quality of the split model at the defense split, against the undefended run."""

    def __init__(self, ctx: Context) -> None:
        cfg = ctx.cfg
        self.local = LocalModel(ctx.files, cfg.defense_head, cfg.defense_tail)
        n = ctx.n_layers
        self.middle = Stage.load(ctx.files, cfg.defense_head, n - cfg.defense_tail, torch.float32)
        self.windows = ctx.corpus.test[: cfg.perplexity_windows]
        self.prompts = [
            ctx.corpus.test[i, : cfg.prompt_tokens].tolist() for i in ctx.spread_windows(cfg.quality_prompts)
        ]
        self.new_tokens = cfg.new_tokens
        self.context = max(cfg.window, cfg.prompt_tokens + cfg.new_tokens)
        self.base_ppl = defenses.perplexity(self.local, self.plain(), self.windows)
        self.reference = defenses.greedy(self.local, self.plain(), self.prompts, self.new_tokens)

    def plain(self, middle: Stage | None = None) -> Callable[[], LocalMiddle]:
        stage = middle or self.middle
        return lambda: LocalMiddle(stage, self.context)

    def measure(self, local: LocalModel, middle: Callable) -> dict:
        ppl = defenses.perplexity(local, middle, self.windows)
        match, exact = defenses.agreement(self.reference, defenses.greedy(local, middle, self.prompts, self.new_tokens))
        return {
            "perplexity": ppl,
            "perplexity_ratio": ppl / self.base_ppl,
            "greedy_match": match,
            "greedy_exact": exact,
        }


def defense_sweep(ctx: Context, attackers: dict[int, Attacker]) -> dict:
    """Every defense at the defense split; `attackers`: MLPs trained on public states, by head depth."""
    cfg, k = ctx.cfg, ctx.cfg.defense_head
    t0 = time.perf_counter()
    quality = Quality(ctx)
    labels = (ctx.corpus.train, ctx.corpus.test)
    public_mlp = (
        attackers.get(k)
        or learned_attacks(ctx, k, ctx.train.states[k], ctx.test.states[k], labels, ctx.model.embed, sequence=False)[1]
    )
    out: dict = {
        "split": {"head": k, "tail": cfg.defense_tail},
        "undefended": {"perplexity": quality.base_ppl},
    }

    noise = []
    for i, sigma in enumerate(cfg.noise_sigmas):
        gen = torch.Generator().manual_seed(cfg.seed + 100 + i)
        train = defenses.add_noise(ctx.train.states[k], sigma, gen)
        test = defenses.add_noise(ctx.test.states[k], sigma, gen)
        row: dict = {"sigma": sigma}
        learned, mlp = learned_attacks(ctx, k, train, test, labels, ctx.model.embed, sequence=True)
        row.update(learned)
        row.update(whitebox_attack(ctx, k, test, mlp, tolerance=WIRE_TOLERANCE + 1.25 * sigma, defended=True))
        row.update(quality.measure(quality.local, lambda s=sigma: defenses.NoisyMiddle(quality.plain()(), s, cfg.seed)))
        noise.append(row)
        log.info("noise sigma=%g: %s", sigma, fmt(row))
    out["noise"] = noise
    out["rotation"] = rotation(ctx, quality, public_mlp)
    out["lowrank"] = lowrank(ctx, quality, public_mlp)
    ctx.timings["defenses"] = time.perf_counter() - t0
    return out


def rotation(ctx: Context, quality: Quality, public_mlp: Attacker) -> dict:
    """A secret rotation: leakage without the key, the key's recovery, leakage with it, and the cost."""
    cfg, k = ctx.cfg, ctx.cfg.defense_head
    q = defenses.random_rotation(ctx.files.config.hidden_size, cfg.seed + 7)
    local = defenses.rotate_local(quality.local, q)
    middle = defenses.rotate_stage(quality.middle, q)
    test = head_states(local.head, local.input_table(), ctx.corpus.test)
    row: dict = {}
    row["public_weights_mlp_top1"] = recovery(top_k(public_mlp, flat(test)), ctx.corpus.test.flatten())[0]
    row.update(
        {f"public_weights_{key}": v for key, v in whitebox_attack(ctx, k, test, public_mlp, defended=True).items()}
    )
    q_weights = defenses.rotation_from_weights(quality.middle, middle)
    # Known plaintext: sessions whose text the server learns; it computes their public states itself.
    plain, seen = (flat(x)[: cfg.known_pairs].float() for x in (ctx.test.states[k], test))
    q_pairs = defenses.procrustes(plain, seen)
    row["key_error_from_server_weights"] = float((q_weights - q).norm() / q.norm())
    row["key_error_from_known_pairs"] = float((q_pairs - q).norm() / q.norm())
    row["known_pairs"] = cfg.known_pairs
    recovered = (test.float() @ q_weights.T).to(WIRE_DTYPE)
    row["recovered_key_mlp_top1"] = recovery(top_k(public_mlp, flat(recovered)), ctx.corpus.test.flatten())[0]
    row.update(
        {f"recovered_key_{key}": v for key, v in whitebox_attack(ctx, k, recovered, public_mlp, defended=True).items()}
    )
    row.update(quality.measure(local, quality.plain(middle)))
    log.info("rotation: %s", fmt(row))
    return row


def lowrank(ctx: Context, quality: Quality, public_mlp: Attacker) -> list[dict]:
    """Secret low-rank changes of the client's layers, per scale: input and output leakage, and cost."""
    cfg, k, n = ctx.cfg, ctx.cfg.defense_head, ctx.n_layers
    rows = []
    labels = (ctx.corpus.train, ctx.corpus.test)
    for i, scale in enumerate(cfg.lowrank_scales):
        local = defenses.perturb_local(quality.local, cfg.seed + 1000 + i, cfg.lowrank_rank, scale)
        train = head_states(local.head, local.input_table(), ctx.corpus.train)
        test = head_states(local.head, local.input_table(), ctx.corpus.test)
        row: dict = {"scale": scale, "rank": cfg.lowrank_rank}
        row["public_weights_mlp_top1"] = recovery(top_k(public_mlp, flat(test)), ctx.corpus.test.flatten())[0]
        row.update(
            {f"public_weights_{key}": v for key, v in whitebox_attack(ctx, k, test, public_mlp, defended=True).items()}
        )
        learned, _ = learned_attacks(ctx, k, train, test, labels, ctx.model.embed, sequence=False)
        row["known_plaintext_mlp_top1"] = learned["mlp_top1"]
        # Output side: the server runs the public tail on what it returns; the client's tail is private.
        windows = quality.windows
        client_next = client_next_tokens(local, quality.middle, windows)
        returned = middle_out(local, quality.middle, windows)
        public_next = whitebox_next_tokens(ctx.model, ctx.model.stack.between(n - cfg.defense_tail, n), returned)
        row["output_whitebox_agreement"] = float((public_next == client_next).float().mean())
        row.update(quality.measure(local, quality.plain()))
        rows.append(row)
        log.info("low-rank scale=%g: %s", scale, fmt(row))
    return rows


@torch.inference_mode()
def middle_out(local: LocalModel, middle: Stage, windows: torch.Tensor) -> torch.Tensor:
    """What the server computes and returns for each window under a private head."""
    heads = head_states(local.head, local.input_table(), windows)
    length = windows.shape[1]
    out = torch.empty_like(heads)
    for i, h in enumerate(heads):
        out[i] = middle(middle.new_cache(length), h.float(), torch.arange(length), Visibility.chain(length), []).to(
            WIRE_DTYPE
        )
    return out


@torch.inference_mode()
def client_next_tokens(local: LocalModel, middle: Stage, windows: torch.Tensor) -> torch.Tensor:
    """The tokens the (defended) client would generate next at every position of each window."""
    length = windows.shape[1]
    out = torch.empty(windows.shape, dtype=torch.long)
    for i, tokens in enumerate(windows):
        pipeline = SplitPipeline(local, LocalMiddle(middle, length), length)
        out[i] = pipeline.score(tokens, torch.arange(length), Visibility.chain(length), [])[0].argmax(-1)
    return out
