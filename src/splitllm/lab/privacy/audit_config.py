"""What an audit runs: the model, the split depths, the attack and defense settings."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from splitllm.lab.privacy.tiny import tiny_model


@dataclass(frozen=True)
class AuditConfig:
    model: str | None = None  # None: the default model
    first_depths: tuple[int, ...] = (1, 2, 4, 6, 8, 12)  # K: layers the client runs before sending
    last_depths: tuple[int, ...] = (0, 1, 2, 4, 8)  # M: layers the client runs after receiving
    window: int = 128
    train_positions: int = 12288
    test_positions: int = 3072
    mlp_epochs: int = 10
    small_train_pairs: int = 1100  # the published attack's training-set size, for comparison
    sequence_epochs: int = 8
    long_window: int = 384  # whole long test contexts the white-box search also inverts...
    long_windows: int = 2  # ...this many
    whitebox_windows: int = 6  # whole test windows inverted, spread over the kinds of text
    whitebox_exhaustive_positions: int = 4  # positions searched over the whole vocabulary for collisions
    whitebox_max_candidates: int | None = 8192  # defended states only (None: the whole vocabulary)
    defense_whitebox_windows: int = 2  # defended states rarely match exactly: searches run longer...
    defense_whitebox_positions: int = 16  # ...so only this many first positions of each
    defense_first: int = 2
    defense_last: int = 2
    noise_sigmas: tuple[float, ...] = (0.03, 0.1, 0.3, 1.0)
    dp_epsilons: tuple[float, ...] = (16.0, 128.0, 1024.0)  # per token, after clipping to the median norm
    dp_delta: float = 1e-5
    map_beam_width: int = 4  # hypotheses the MAP attack on noised states keeps
    lowrank_scales: tuple[float, ...] = (0.02, 0.1)
    lowrank_rank: int = 8
    known_pairs: int = 640  # state pairs a known-plaintext attacker gets to fit a rotation
    perplexity_windows: int = 8  # held-out windows the defenses' cost is measured on
    private_first_depths: tuple[int, ...] = ()  # K at which to train and attack a private first stage (slow: opt in)
    private_steps: int = 40
    private_kl_budget: float = 0.05  # nats per token from the public model's next-token distribution
    private_rank: int = 8
    private_length: int = 64  # training window (tokens)
    threads: int = 1
    seed: int = 0
    out_dir: Path = Path("results/privacy")

    @classmethod
    def reduced(cls, **overrides: object) -> AuditConfig:
        """The default model at the default split, small sets and one setting per defense: what a 2-core
        machine shared with heavy jobs finishes in about half an hour."""
        base = cls(
            first_depths=(2,),
            last_depths=(0,),
            train_positions=1024,
            test_positions=640,  # five windows: every kind of text is tested
            sequence_epochs=2,
            whitebox_windows=2,
            long_windows=0,
            whitebox_exhaustive_positions=1,
            whitebox_max_candidates=512,
            defense_whitebox_windows=1,
            defense_whitebox_positions=8,
            noise_sigmas=(1.0,),
            dp_epsilons=(1024.0,),
            lowrank_scales=(0.1,),
            perplexity_windows=2,
        )
        return replace(base, **overrides)  # type: ignore[arg-type]

    @classmethod
    def quick(cls, **overrides: object) -> AuditConfig:
        """A minute or two on a tiny random model (built once): for CI and for trying the pipeline out."""
        base = cls(
            model=str(tiny_model()),
            first_depths=(1, 2),
            last_depths=(0, 1),
            window=32,
            train_positions=2048,
            test_positions=512,
            mlp_epochs=30,
            small_train_pairs=256,
            sequence_epochs=2,
            long_window=0,
            long_windows=0,
            whitebox_windows=2,
            whitebox_exhaustive_positions=1,
            whitebox_max_candidates=2048,
            defense_whitebox_windows=1,
            defense_whitebox_positions=8,
            defense_first=1,
            defense_last=1,
            noise_sigmas=(0.1,),
            dp_epsilons=(64.0,),
            lowrank_scales=(0.1,),
            known_pairs=128,
            perplexity_windows=2,
            private_first_depths=(1,),
            private_steps=4,
            private_length=32,
        )
        return replace(base, **overrides)  # type: ignore[arg-type]
