"""`splitllm draft train`: a drafter for a model, trained here from its own answers and features."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer

from splitllm.commands.options import Model, Threads, reported, set_threads

app = typer.Typer(no_args_is_help=True, help="The client's learned drafter: train a drafter for a model.")


@app.command("train")
def train(
    out: Annotated[str, typer.Option(help="folder for head.safetensors and head.json")],
    model: Model = "default",
    prompts: Annotated[int, typer.Option(help="self-distillation prompts the model answers")] = 480,
    max_new_tokens: Annotated[int, typer.Option(help="tokens per answer at most")] = 160,
    texts: Annotated[int, typer.Option(help="passages of standard-library prose and code")] = 96,
    generate_batch: Annotated[int, typer.Option(help="prompts answered together (features are taken in the same pass)")] = 32,
    capture_dtype: Annotated[str, typer.Option(help="the target's precision while answering: bfloat16 or float32")] = "bfloat16",
    vocab: Annotated[int, typer.Option(help="draft vocabulary: the most frequent target tokens")] = 8192,
    intermediate: Annotated[Optional[int], typer.Option(help="the drafter's MLP width (default: the target's)")] = None,
    weights: Annotated[str, typer.Option(help="how the drafter's matrices are stored: float16 or int8")] = "float16",
    epochs: Annotated[int, typer.Option(help="passes over the training data")] = 6,
    passes: Annotated[int, typer.Option(help="unrolled draft steps per position while training")] = 3,
    seed: int = 0,
    work: Annotated[Optional[str], typer.Option(help="folder caching answers and features (default: under the cache)")] = None,
    threads: Threads = None,
) -> None:
    """Train an EAGLE-style drafter on the model's own answers and features; write weights and metadata."""
    from splitllm.lab.training.build import DataSettings, build_head
    from splitllm.lab.training.train import TrainSettings

    set_threads(threads)
    with reported(ValueError, FileNotFoundError):
        meta = build_head(
            model, out,
            DataSettings(prompts=prompts, max_new_tokens=max_new_tokens, texts=texts, generate_batch=generate_batch,
                         dtype=capture_dtype, seed=seed),
            TrainSettings(vocab=vocab, intermediate=intermediate, epochs=epochs, passes=passes, seed=seed),
            work=work, weights=weights, command=["splitllm", *sys.argv[1:]],
        )
    typer.echo(json.dumps({k: meta[k] for k in ("validation", "seconds", "size_bytes")}, indent=1))
    typer.echo(f"wrote {out}/head.safetensors and head.json", err=True)
