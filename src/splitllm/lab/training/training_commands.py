"""`splitllm drafter train`: a drafter for a model, trained here from its own answers and features."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from splitllm.commands.wiring import Values, command, reported, set_threads
from splitllm.lab.training.recipes import recipe_for
from splitllm.options import DRAFTER_COMPARE, DRAFTER_TRAIN

app = typer.Typer(no_args_is_help=True,
                  help="The client's learned drafter: train one for a model, "
                       "compare drafters on held-out conversations.")


def layer_counts(text: str) -> tuple[int, ...]:
    """'2,26' -> (2, 26); '' -> ()."""
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise typer.BadParameter(f"--taps takes layer counts separated by commas, such as 2,26, not {text!r}") from None


@command(app, DRAFTER_TRAIN, training=Values)
def train(training: Values, out: str, model: str, max_new_tokens: int, work: str | None, threads: int | None) -> None:
    """Train an EAGLE-style drafter on the model's own answers and features; write its weights and metadata,
    drafter.safetensors and drafter.json, into --out.

    What the run's size options leave out comes from the model's recipe (sized for about an hour here)."""
    from splitllm.lab.training.build import DataSettings, build_drafter
    from splitllm.lab.training.train import TrainSettings

    t = training
    if t.init is not None and t.intermediate is not None:
        raise typer.BadParameter("a continued drafter keeps its width: give --init or --intermediate, not both",
                                 param_hint="'--intermediate'")
    set_threads(threads)
    given = {name: getattr(t, name) for name in ("prompts", "epochs", "generate_batch", "weights", "intermediate")}
    recipe = recipe_for(model).given(**given)
    if t.init is not None:
        recipe = recipe.continuing()
    # The command in the metadata names what the recipe chose, so it reproduces the run if recipes change.
    line = ["splitllm", *sys.argv[1:], *recipe.as_options(k for k, v in given.items() if v is None)]
    with reported(ValueError, FileNotFoundError):
        meta = build_drafter(
            model, out,
            DataSettings(prompts=recipe.prompts, follow_ups=t.follow_ups, max_new_tokens=max_new_tokens, texts=t.texts,
                         generate_batch=recipe.generate_batch, dtype=t.capture_dtype, taps=layer_counts(t.taps),
                         seed=t.seed),
            TrainSettings(vocab=t.vocab, intermediate=recipe.intermediate, epochs=recipe.epochs, passes=t.passes,
                          lr=t.lr, feature_weight=t.feature_weight, seed=t.seed),
            work=work, weights=recipe.weights, command=line, init=t.init,
        )
    typer.echo(json.dumps({k: meta[k] for k in ("validation", "seconds", "size_bytes")}, indent=1))
    typer.echo(f"wrote {out}/drafter.safetensors and drafter.json", err=True)


@command(app, DRAFTER_COMPARE)
def compare(
    drafter: list[str], model: str, per_kind: int, max_new_tokens: int, depth: int, out: str, threads: int | None,
) -> None:
    """Held-out acceptance per depth of drafters, on conversations and code no training prompt draws from;
    the figures also go to drafter_compare.json in --out."""
    from splitllm.lab.training.build import DataSettings
    from splitllm.lab.training.evaluate import compare_drafters

    set_threads(threads)
    with reported(ValueError, FileNotFoundError):
        result = compare_drafters(
            model, [None if d == "shipped" else d for d in drafter], per_kind, depth,
            DataSettings(max_new_tokens=max_new_tokens),
        )
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, "drafter_compare.json").write_text(json.dumps(result, indent=1))
    for name, kinds in result["drafters"].items():
        for kind in result["kinds"]:
            v = kinds[kind]
            rates = " ".join(f"{a:.2f}" for a in v["acceptance"])
            ranks = ",".join(str(k) for k in v["in_top"])
            top = " ".join(f"{share:.2f}" for share in v["in_top"].values())
            typer.echo(f"{name:40.40s} {kind:12s} acceptance per depth {rates}  "
                       f"mean accepted {v['mean_accepted']:.2f}  depth 1 in top {ranks}: {top}  "
                       f"outside vocab {v['outside_vocab']:.2f}")
