"""Training a drafter on the target's features: EAGLE-1 losses with unrolled deeper steps.

Pass 0 feeds real features: row t takes (f_t, e(x_{t+1})) at position t and guesses f_{t+1}. Pass k
feeds pass k-1's guesses back, as the proposer does when it drafts k tokens deep: row t takes (the
guess of f_t, e(g_t)) where g_t is the target's greedy token after position t, and attends to the real
entries of positions <= t-k plus the one guess per deeper pass on its own chain (training-time test,
as in HASS/EAGLE-3). Every pass is scored against the real f_{t+1} (smooth-L1) and the target's
next-token distribution restricted to the draft vocabulary (cross-entropy). The drafter's decoder layer
starts as a copy of the target's last layer, and `fc` as the identity on the feature half; or, with
`init`, as another drafter (a tapped drafter then starts as that drafter: its `fuse` adds nothing yet).
A tapped drafter's pass 0 fuses each real feature with the tapped layers' outputs at its position.

Validation on held-out sequences measures greedy acceptance per depth: the share of chains where the
depth-k draft equals the target's greedy token, given the first k-1 were accepted; and at depth 1, how
often that token is among the drafter's top k (what a wider tree can find) or outside its vocabulary.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from splitllm.kernels import cpu_kernels
from splitllm.lab.training.data import Features
from splitllm.drafting.drafter import Drafter, drafter_config
from splitllm.model.blocks import Segment, rms_norm
from splitllm.model.ends import ModelEnds
from splitllm.model.stage import Stage


@dataclass(frozen=True)
class TrainSettings:
    vocab: int = 8192  # draft vocabulary: the most frequent target tokens of the data
    # the drafter's MLP width (None: the target's; narrower keeps its strongest channels, wider adds some)
    intermediate: int | None = None
    epochs: int = 6
    passes: int = 3  # unrolled steps per position while training (1 = EAGLE-1 teacher forcing only)
    batch_tokens: int = 512
    lr: float = 1e-3
    feature_weight: float = 1.0  # the smooth-L1 feature loss beside the token loss (0: EAGLE-3's token loss alone)
    token_weight: float = 1.0
    scale_features: bool = True  # feature loss on features divided by their RMS over the data
    pass_decay: float = 0.8  # loss weight of pass k is decay**k
    validation_share: float = 0.06
    validation_depth: int = 5
    # matrix products under bfloat16 autocast where the CPU multiplies bfloat16 in hardware (several times faster
    # than float32 there, several times slower where it is emulated), float32 master weights
    bfloat16: bool = field(default_factory=cpu_kernels.native_bfloat16)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"--lr must be positive, not {self.lr}")
        if not self.feature_weight >= 0:
            raise ValueError(f"--feature-weight must be at least 0, not {self.feature_weight}")
        for name in ("vocab", "epochs", "passes", "batch_tokens", "validation_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.intermediate is not None and self.intermediate < 1:
            raise ValueError("--intermediate must be at least 1")
        if not 0 <= self.validation_share < 1:
            raise ValueError("the validation share must lie in [0, 1)")


@dataclass
class Sequence_:
    """One training sequence: tokens, real features, the target's greedy next tokens and vocab labels."""

    ids: torch.Tensor  # (T,)
    feats: torch.Tensor  # (T, d) top-layer features
    taps: torch.Tensor | None = None  # (T, taps * d) the tapped layers' outputs (float16), for a tapped drafter
    greedy: torch.Tensor | None = None  # (T,) target's greedy token after each position (validation only)


class Target:
    """The client's own pieces the drafter is trained against: embedding, final norm, LM head."""

    def __init__(self, ends: ModelEnds) -> None:
        self.embed = ends.input_table()  # scaled as layer 0 sees it, for families that scale it
        self.norm = ends.norm
        self.lm_head = ends.lm_head.weight
        self.eps = ends.cfg.rms_norm_eps
        self.softcap = ends.cfg.final_logit_softcap

    @torch.no_grad()
    def greedy(self, feats: torch.Tensor, chunk: int = 512) -> torch.Tensor:
        return torch.cat([(rms_norm(f, self.norm, self.eps) @ self.lm_head.T).argmax(-1) for f in feats.split(chunk)])

    def drafter_vocab_logits(self, feats: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (`rows` = the LM head's rows for it), soft-capped as the target's."""
        logits = rms_norm(feats, self.norm, self.eps) @ rows.T
        return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap


def draft_vocabulary(data: Sequence[Sequence_], size: int, vocab_size: int) -> list[int]:
    """The `size` most frequent tokens of the data (mostly the target's own answers), most frequent first,
    then the lowest unseen ids (a BPE vocabulary lists its common pieces first)."""
    counts: Counter[int] = Counter()
    for s in data:
        counts.update(s.ids.tolist())
    ids = [t for t, _ in counts.most_common(size)]
    seen = set(ids)
    ids += [t for t in range(vocab_size) if t not in seen][: max(0, min(size, vocab_size) - len(ids))]
    return ids


def _visibility(n: int, k: int) -> torch.Tensor:
    """(1, 1, n, (k+1) n) additive mask of pass k: real entries <= i-k, then one guess per pass on row i's chain."""
    i = torch.arange(n)[:, None]
    c = torch.arange(n)[None, :]
    blocks = [c <= i - k] + [c == i - k + j for j in range(1, k + 1)]
    visible = torch.cat(blocks, dim=1)
    mask = torch.zeros(visible.shape)
    mask.masked_fill_(~visible, float("-inf"))
    return mask[None, None]


def unrolled(
    drafter: Drafter, target: Target, batch: Sequence[Sequence_], passes: int, greedy: bool = False
) -> list[torch.Tensor]:
    """Predicted features of every pass, rows of all sequences stacked: [(rows, d)] * passes.

    Row t of a sequence of length T (t < T-1) guesses f_{t+1}; pass k's rows t < k have no full chain.
    Deeper passes take the token x_{t+1} of the data (teacher forcing: the answers are the target's own
    greedy choices), or with `greedy` the target's greedy token, as greedy drafting meets it.
    """
    layer, rotary = drafter.stage.layers[0], drafter.stage.rotaries[0]
    cfg = drafter.cfg
    lens = [int(s.ids.numel()) - 1 for s in batch]
    feats_in = torch.cat([s.feats[:-1] for s in batch])
    taps_in = _taps(drafter, batch)
    tokens = torch.cat([s.ids[1:] for s in batch])
    deep_tokens = torch.cat([s.greedy[:-1] for s in batch]) if greedy else tokens
    rope = [rotary(torch.arange(n), torch.float32) for n in lens]
    kv = [
        (torch.zeros(1, cfg.num_kv_heads, 0, cfg.head_dim), torch.zeros(1, cfg.num_kv_heads, 0, cfg.head_dim))
        for _ in lens
    ]
    outs: list[torch.Tensor] = []
    for k in range(passes):
        if k:
            prev = outs[-1]
            shifted = torch.cat([torch.cat([f[:1], p[:-1]]) for f, p in zip(feats_in.split(lens), prev.split(lens))])
            x = drafter.combine(shifted, target.embed[deep_tokens])
        else:
            x = drafter.combine(feats_in, target.embed[tokens], taps_in)
        segments, bufs, row = [], [], 0
        for n, (cos, sin), (kc, vc) in zip(lens, rope, kv):
            pad = torch.zeros(1, cfg.num_kv_heads, n, cfg.head_dim)
            bufs.append((torch.cat([kc, pad], dim=2), torch.cat([vc, pad], dim=2)))
            segments.append(Segment(slice(row, row + n), cos, sin, _visibility(n, k), k * n))
            row += n
        outs.append(layer(x[None], segments, bufs)[0])
        kv = bufs
    return outs


def _taps(drafter: Drafter, batch: Sequence[Sequence_]) -> torch.Tensor | None:
    """The tapped outputs of every row that has a next token, for a tapped drafter; None for another."""
    if not drafter.taps:
        return None
    if any(s.taps is None for s in batch):
        raise ValueError(f"a drafter fusing the outputs of layers {list(drafter.taps)} needs them in its data")
    return torch.cat([s.taps[:-1].float() for s in batch])


def _labels(batch: Sequence[Sequence_], target: Target, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row t: the real f_{t+1} and the target's draft-vocabulary distribution of x_{t+2}."""
    feats = torch.cat([s.feats[1:] for s in batch])
    with torch.no_grad():
        probs = F.softmax(target.drafter_vocab_logits(feats, rows), dim=-1)
    return feats, probs


def _valid_rows(batch: Sequence[Sequence_], k: int) -> torch.Tensor:
    return torch.cat([torch.arange(int(s.ids.numel()) - 1) >= k for s in batch])


def batches(data: Sequence[Sequence_], tokens: int, rng: random.Random) -> list[list[Sequence_]]:
    order = list(data)
    rng.shuffle(order)
    out, cur, size = [], [], 0
    for s in order:
        if cur and size + s.ids.numel() > tokens:
            out.append(cur)
            cur, size = [], 0
        cur.append(s)
        size += int(s.ids.numel())
    return out + ([cur] if cur else [])


def prepare(feats: Features, target: Target | None = None) -> list[Sequence_]:
    """Training sequences; with `target`, also its greedy tokens (a full LM-head pass: validation only)."""
    out = []
    for ids, f in zip(feats.ids, feats.features):
        if ids.numel() > 2:
            d = f.shape[-1] // (len(feats.taps) + 1)
            top = f[:, -d:].float()
            out.append(Sequence_(ids, top, f[:, :-d].half() if feats.taps else None,
                                 target.greedy(top) if target else None))
    return out


def new_drafter(
    ends: ModelEnds, vocab: Sequence[int], intermediate: int | None = None, taps: Sequence[int] = (),
    init: Drafter | None = None
) -> Drafter:
    """A drafter whose layer starts as the target's last layer and whose fc passes the feature through;
    with `init` (an unpacked drafter), a copy of that one instead (its vocabulary and width), continued.
    A tapped drafter's `fuse` starts at zero, so it starts as the plain one.

    A narrower MLP (`intermediate` below the target's) keeps the last layer's channels that carry the most,
    by the product of their up and down weights' norms: at 1.5B a full layer (52 M parameters) would not
    fit the package, and costs as much to draft with as a tenth of the client's share of the model. A wider one adds
    channels with random gate and up rows and zero down columns, so it starts as the last layer too."""
    cfg = ends.cfg
    if init is not None:
        if init.taps:
            raise ValueError("a drafter continues from a plain one (one without taps)")
        drafter = Drafter(init.cfg, init.vocab, taps=taps)
        drafter.load_state_dict(init.state_dict(), strict=False)
        return _trainable(drafter)
    width = intermediate or cfg.intermediate_size
    drafter = Drafter(drafter_config(cfg, width), vocab, taps=taps)
    last = cfg.num_layers - 1
    weights = Stage.load(ends.files, last, last + 1, torch.float32).state_dict()
    gate, up = weights["layers.0.gate_up.weight"].chunk(2)
    down = weights["layers.0.down.weight"]
    if width < cfg.intermediate_size:
        keep = (up.norm(dim=1) * down.norm(dim=0)).topk(width).indices.sort().values
        gate, up, down = gate[keep], up[keep], down[:, keep]
    elif width > cfg.intermediate_size:
        added = width - cfg.intermediate_size
        generator = torch.Generator().manual_seed(0)
        scale = float(gate.std())
        gate, up = (torch.cat([w, torch.randn(added, w.shape[1], generator=generator) * scale]) for w in (gate, up))
        down = torch.cat([down, down.new_zeros(down.shape[0], added)], dim=1)
    weights["layers.0.gate_up.weight"] = torch.cat([gate, up])
    weights["layers.0.down.weight"] = down.contiguous()
    drafter.stage.load_state_dict(weights)
    d = cfg.hidden_size
    with torch.no_grad():
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, :d] = torch.eye(d)
        drafter.fc.weight[:, d:].normal_(0, 0.02)
        drafter.fc.bias.zero_()
    return _trainable(drafter)


def _trainable(drafter: Drafter) -> Drafter:
    """`fuse` (if any) at zero, adding nothing to the top feature yet; every parameter trainable."""
    if drafter.fuse is not None:
        with torch.no_grad():
            drafter.fuse.weight.zero_()
    for p in drafter.parameters():
        p.requires_grad_(True)
    return drafter


RANKS = (1, 2, 4, 6, 8, 10)  # the top-k shares validation reports at depth 1: what a tree's width can find


@dataclass
class Validation:
    acceptance: list[float]  # per depth: P(depth k accepted | depths < k accepted)
    reached: list[int]  # chains that reached each depth
    mean_accepted: float  # expected accepted draft tokens per chain (greedy, one chain)
    positions: int
    # per k of RANKS: share of positions whose depth-1 target token is among the drafter's top k
    in_top: dict[int, float]
    outside_vocab: float  # share of positions whose depth-1 target token the draft vocabulary lacks


@torch.no_grad()
def validate(drafter: Drafter, target: Target, data: Sequence[Sequence_], depth: int, tokens: int = 2048) -> Validation:
    vocab_index = _vocab_index(drafter, target)
    rows = target.lm_head[drafter.vocab]
    reached = [0] * (depth + 1)
    total_accepted = 0
    in_top = dict.fromkeys(RANKS, 0)
    outside = rows_seen = 0
    for batch in batches(data, tokens, random.Random(0)):
        outs = unrolled(drafter, target, batch, depth, greedy=True)
        greedy = vocab_index[torch.cat([s.greedy[1:] for s in batch])]  # -1: outside the draft vocabulary
        logits = [target.drafter_vocab_logits(o, rows) for o in outs]
        ranked = logits[0].topk(min(max(RANKS), rows.shape[0]), -1).indices == greedy[:, None]
        for k in RANKS:
            in_top[k] += int(ranked[:, :k].any(-1).sum())
        outside += int((greedy < 0).sum())
        rows_seen += greedy.numel()
        hits = torch.stack([lg.argmax(-1) == greedy for lg in logits])  # (depth, rows)
        lens = [int(s.ids.numel()) - 1 for s in batch]
        for h in hits.split(lens, dim=1):
            n = h.shape[1]
            bases = n - depth
            if bases <= 0:
                continue
            # chain from base b: pass j at row b + j
            chain = torch.stack([h[j, j : j + bases] for j in range(depth)])  # (depth, bases)
            run = chain.int().cumprod(0)
            reached[0] += bases
            for j in range(depth):
                reached[j + 1] += int(run[j].sum())
            total_accepted += int(run.sum())
    acceptance = [reached[j + 1] / reached[j] if reached[j] else 0.0 for j in range(depth)]
    rows_seen = max(rows_seen, 1)
    return Validation(acceptance, reached, total_accepted / max(reached[0], 1), reached[0],
                      {k: n / rows_seen for k, n in in_top.items()}, outside / rows_seen)


def feature_rms(data: Sequence[Sequence_]) -> float:
    """Root mean square of the target's features: their scale (tens, with outlier dimensions in the thousands)."""
    total = sum(float(s.feats.pow(2).sum()) for s in data)
    return math.sqrt(total / max(sum(s.feats.numel() for s in data), 1))


def _vocab_index(drafter: Drafter, target: Target) -> torch.Tensor:
    index = torch.full((target.lm_head.shape[0],), -1, dtype=torch.long)
    index[drafter.vocab] = torch.arange(drafter.vocab.numel())
    return index


def _loss(
    outs: Sequence[torch.Tensor], batch: Sequence[Sequence_], feats: torch.Tensor, probs: torch.Tensor, target: Target,
    rows: torch.Tensor, scale: float, settings: TrainSettings,
) -> torch.Tensor:
    """Every pass scored against the real next feature (smooth-L1) and the target's distribution (cross-entropy)."""
    loss = torch.zeros(())
    for k, pred in enumerate(outs):
        ok = _valid_rows(batch, k)
        feat_loss = F.smooth_l1_loss(pred[ok].float() / scale, feats[ok] / scale)
        logp = F.log_softmax(target.drafter_vocab_logits(pred[ok], rows), dim=-1)
        token_loss = -(probs[ok] * logp).sum(-1).mean()
        loss = loss + settings.pass_decay**k * (
            settings.feature_weight * feat_loss + settings.token_weight * token_loss
        )
    return loss


@dataclass(frozen=True)
class _Checkpoint:
    """Where training saves its state after every epoch (None: nowhere), and what a saved state must
    match for a run to resume from it."""

    path: Path | None
    identity: list

    def resume(
        self, drafter: Drafter, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler
    ) -> tuple[list[float], int]:
        """The loss history and the epochs done of a saved run that matches, its state loaded; else none."""
        if self.path is None or not self.path.is_file():
            return [], 0
        saved = torch.load(self.path, weights_only=False)
        if saved["identity"] != self.identity:
            return [], 0
        drafter.load_state_dict(saved["drafter"])
        opt.load_state_dict(saved["opt"])
        sched.load_state_dict(saved["sched"])
        return saved["history"], saved["epochs"]

    def save(
        self, drafter: Drafter, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
        history: list[float], epochs: int,
    ) -> None:
        if self.path is None:
            return
        state = {"identity": self.identity, "drafter": drafter.state_dict(), "opt": opt.state_dict(),
                 "sched": sched.state_dict(), "history": history, "epochs": epochs}
        torch.save(state, self.path.with_suffix(".tmp"))
        self.path.with_suffix(".tmp").replace(self.path)


def _optimizer(
    params: list[torch.nn.Parameter], lr: float, steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW with a linear warmup over the first 5% of `steps`, then a cosine decay to zero."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min((i + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(i / steps, 1.0))))
    )
    return opt, sched


def train(
    drafter: Drafter,
    target: Target,
    data: Sequence[Sequence_],
    settings: TrainSettings,
    progress: Callable[[int, float], None] | None = None,
    checkpoint: Path | None = None,
) -> dict:
    """Train in place; returns the loss history. `progress(tokens, loss)` after every step.

    With `checkpoint`, the drafter, the optimizer and the history are saved there after every epoch, and a
    run with the same settings and data resumes after the last saved epoch (the batches of every epoch are
    drawn up front from the seed, so a resumed run takes the same steps)."""
    rng = random.Random(settings.seed)
    torch.manual_seed(settings.seed)
    rows = target.lm_head[drafter.vocab]
    scale = feature_rms(data) if settings.scale_features else 1.0
    params = [p for p in drafter.parameters() if p.requires_grad]
    plan = [batches(data, settings.batch_tokens, rng) for _ in range(settings.epochs)]
    steps = sum(map(len, plan))
    opt, sched = _optimizer(params, settings.lr, steps)
    tokens = sum(int(s.ids.numel()) for s in data)
    saves = _Checkpoint(checkpoint, [asdict(settings), tokens, len(data), drafter.vocab.tolist()[:64]])
    history, start = saves.resume(drafter, opt, sched)
    if start and progress:
        progress(start * tokens, history[-1] if history else None)
    drafter.train()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bfloat16)
    for e in range(start, settings.epochs):
        for batch in plan[e]:
            feats, probs = _labels(batch, target, rows)
            with autocast:
                loss = _loss(unrolled(drafter, target, batch, settings.passes), batch, feats, probs, target, rows,
                             scale, settings)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            history.append(loss.item())
            if progress:
                progress(sum(int(s.ids.numel()) for s in batch), history[-1])
        saves.save(drafter, opt, sched, history, e + 1)
    drafter.eval()
    for p in drafter.parameters():
        p.requires_grad_(False)
    return {"steps": steps, "first_loss": history[0] if history else None,
            "last_loss": history[-1] if history else None,
            "settings": asdict(settings)}
