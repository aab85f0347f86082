"""`splitllm draft train`: a drafter for a model, trained here from its own answers and features."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from splitllm.commands.options import Model, Threads, reported, set_threads
from splitllm.lab.training.recipes import recipe_for

RECIPE = " (default: the model's recipe, docs/drafting.md)"

app = typer.Typer(no_args_is_help=True, help="The client's learned drafter: train one for a model, compare heads on held-out conversations.")


def layer_counts(text: str) -> tuple[int, ...]:
    """'2,26' -> (2, 26); '' -> ()."""
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise typer.BadParameter(f"--taps takes layer counts separated by commas, such as 2,26, not {text!r}") from None


@app.command("train")
def train(
    out: Annotated[str, typer.Option(help="folder for drafter.safetensors and drafter.json")],
    model: Model = "default",
    prompts: Annotated[Optional[int], typer.Option(help="self-distillation conversations the model answers" + RECIPE)] = None,
    follow_ups: Annotated[float, typer.Option(help="share of conversations with a second user turn")] = 0.3,
    max_new_tokens: Annotated[int, typer.Option(help="tokens per answer at most")] = 160,
    texts: Annotated[int, typer.Option(help="passages of standard-library prose and code")] = 96,
    generate_batch: Annotated[Optional[int], typer.Option(help="prompts answered together (features are taken in the same pass)"
                                                          + RECIPE)] = None,
    capture_dtype: Annotated[str, typer.Option(help="the target's precision while answering: bfloat16 or float32")] = "bfloat16",
    vocab: Annotated[int, typer.Option(help="draft vocabulary: the most frequent target tokens")] = 8192,
    intermediate: Annotated[Optional[int], typer.Option(help="the drafter's MLP width: the recipe's, else the target's; "
                                                       "narrower keeps its strongest channels, wider adds channels")] = None,
    weights: Annotated[Optional[str], typer.Option(help="how the drafter's matrices are stored: float16 or int8" + RECIPE)] = None,
    epochs: Annotated[Optional[int], typer.Option(help="passes over the training data" + RECIPE)] = None,
    passes: Annotated[int, typer.Option(help="unrolled draft steps per position while training")] = 3,
    lr: Annotated[float, typer.Option(help="peak learning rate (lower to continue a trained head with --init)")] = 1e-3,
    feature_weight: Annotated[float, typer.Option(help="weight of the feature loss beside the token loss (0: the token "
                                                  "loss alone, as EAGLE-3)")] = 1.0,
    taps: Annotated[str, typer.Option(help="layers whose outputs the head fuses with the top feature, e.g. '2,26' for "
                                      "a 28-layer model split 2+2 (the client's head output and the middle's return)")] = "",
    init: Annotated[Optional[str], typer.Option(help="continue from this drafter folder ('shipped': the package's) "
                                                "instead of the target's last layer")] = None,
    seed: int = 0,
    work: Annotated[Optional[str], typer.Option(help="folder caching answers and features (default: under the cache)")] = None,
    threads: Threads = None,
) -> None:
    """Train an EAGLE-style drafter on the model's own answers and features; write weights and metadata.

    What the run's size options leave out comes from the model's recipe (sized for about an hour here)."""
    from splitllm.lab.training.build import DataSettings, build_head
    from splitllm.lab.training.train import TrainSettings

    if init is not None and intermediate is not None:
        raise typer.BadParameter("a continued head keeps its width: give --init or --intermediate, not both",
                                 param_hint="'--intermediate'")
    set_threads(threads)
    given = {"prompts": prompts, "epochs": epochs, "generate_batch": generate_batch, "weights": weights,
             "intermediate": intermediate}
    recipe = recipe_for(model).given(**given)
    if init is not None:
        recipe = recipe.continuing()
    # The command in the metadata names what the recipe chose, so it reproduces the run if recipes change.
    command = ["splitllm", *sys.argv[1:], *recipe.as_options(k for k, v in given.items() if v is None)]
    with reported(ValueError, FileNotFoundError):
        meta = build_head(
            model, out,
            DataSettings(prompts=recipe.prompts, follow_ups=follow_ups, max_new_tokens=max_new_tokens, texts=texts,
                         generate_batch=recipe.generate_batch, dtype=capture_dtype, taps=layer_counts(taps), seed=seed),
            TrainSettings(vocab=vocab, intermediate=recipe.intermediate, epochs=recipe.epochs, passes=passes, lr=lr,
                          feature_weight=feature_weight, seed=seed),
            work=work, weights=recipe.weights, command=command, init=init,
        )
    typer.echo(json.dumps({k: meta[k] for k in ("validation", "seconds", "size_bytes")}, indent=1))
    typer.echo(f"wrote {out}/drafter.safetensors and drafter.json", err=True)


@app.command("compare")
def compare(
    drafter: Annotated[list[str], typer.Option(help="drafter folder to score (repeat; 'shipped' for the package's)")],
    model: Model = "default",
    per_kind: Annotated[int, typer.Option(help="held-out conversations per kind (conversation, code)")] = 48,
    max_new_tokens: Annotated[int, typer.Option(help="tokens per answer at most")] = 160,
    depth: Annotated[int, typer.Option(help="draft depth scored")] = 5,
    out: Annotated[Optional[str], typer.Option(help="file for the comparison's JSON")] = None,
    threads: Threads = None,
) -> None:
    """Held-out acceptance per depth of drafters, on conversations and code no training prompt draws from."""
    from splitllm.lab.training.build import DataSettings
    from splitllm.lab.training.evaluate import compare_heads

    set_threads(threads)
    with reported(ValueError, FileNotFoundError):
        result = compare_heads(
            model, [None if d == "shipped" else d for d in drafter], per_kind, depth,
            DataSettings(max_new_tokens=max_new_tokens),
        )
    text = json.dumps(result, indent=1)
    if out:
        Path(out).write_text(text)
    for name, kinds in result["heads"].items():
        for kind in result["kinds"]:
            v = kinds[kind]
            rates = " ".join(f"{a:.2f}" for a in v["acceptance"])
            ranks = ",".join(str(k) for k in v["in_top"])
            top = " ".join(f"{share:.2f}" for share in v["in_top"].values())
            typer.echo(f"{name:40.40s} {kind:12s} acceptance per depth {rates}  mean accepted {v['mean_accepted']:.2f}  "
                       f"depth 1 in top {ranks}: {top}  outside vocab {v['outside_vocab']:.2f}")
