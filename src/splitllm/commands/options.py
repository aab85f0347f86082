"""The options commands share, declared once, and the few helpers every command's wiring uses.

Every option also reads an environment variable, `SPLITLLM_<COMMAND>_<OPTION>` (click's automatic
variables, shown in `--help`), as llama.cpp's server reads `LLAMA_ARG_*`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import inspect
from collections.abc import Callable, Iterator
from typing import Annotated, Any, Literal, NoReturn, Optional

import typer

from splitllm.decoding.modes import DECODERS
from splitllm.weights.packaged import PACKAGED_MODELS
from splitllm.model.precision import EXACT, Precision, fastest
from splitllm.protocol.wire import WIRE_DTYPES

ENV_PREFIX = "SPLITLLM"
# What each setting costs against float32 (perplexity, `splitllm bench quality`) is in docs/precision.md;
# the help strings point there rather than quote figures that go stale.
COSTS = "each setting's cost against float32: docs/precision.md"

Model = Annotated[str, typer.Option(help=f"{', '.join(map(repr, PACKAGED_MODELS))}, an HF folder or a .gguf file")]
Head = Annotated[int, typer.Option(help="layers the client runs before the server's (K)")]
Tail = Annotated[int, typer.Option(help="layers the client runs after the server's (M)")]
DecodeMode = Literal[tuple(DECODERS)]  # type: ignore[valid-type]
Decode = Annotated[
    DecodeMode, typer.Option(help="decoding mode: auto sizes speculation for the link; greedy output is the same in all")
]
Threads = Annotated[Optional[int], typer.Option(help="compute threads (default: the cores this process may use)")]
Setting = Annotated[
    Optional[str],
    typer.Option(help="dtype-quant of both sides: bfloat16-int8, bfloat16-int4, bfloat16-none or float32-none (exact) "
                      f"(default: the fastest here; {COSTS})"),
]
WireDtypeName = Literal[tuple(WIRE_DTYPES)]  # type: ignore[valid-type]
WireDtype = Annotated[WireDtypeName, typer.Option(help="hidden states on the wire")]
RttMs = Annotated[float, typer.Option(help="emulated round-trip time, ms")]
Port = Annotated[int, typer.Option(min=1, max=65535, help="TCP port to listen on")]


def fail(message: object, code: int = 2) -> NoReturn:
    """Stop the command with one line on stderr: what went wrong, never a traceback."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@contextlib.contextmanager
def reported(*errors: type[BaseException], code: int = 2) -> Iterator[None]:
    """Turn the expected failures of a block (bad input, a missing file, a refusing server) into `fail`."""
    try:
        yield
    except errors as exc:
        fail(exc, code)


def numbers(text: str, kind: type) -> tuple:
    """A comma-separated list of numbers, the form every option taking several values uses."""
    try:
        return tuple(kind(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise typer.BadParameter(f"not a comma-separated list of numbers: {text!r}") from None


def need_extra(extra: str) -> None:
    """Stop with the install line when any distribution the optional part `extra` declares is missing."""
    from packaging.requirements import Requirement

    wanted = [Requirement(r) for r in importlib.metadata.requires("splitllm") or ()]
    missing = []
    for req in wanted:
        if req.name != "splitllm" and req.marker is not None and req.marker.evaluate({"extra": extra}):
            try:
                importlib.metadata.distribution(req.name)
            except importlib.metadata.PackageNotFoundError:
                missing.append(req.name)
    if missing:
        fail(f"this command needs the '{extra}' extra ({', '.join(missing)} missing): pip install 'splitllm[{extra}]'")


def set_threads(threads: int | None) -> int:
    """Apply --threads (default: every core this process may use); returns the count."""
    from splitllm.threads import available_cores, set_compute_threads

    n = available_cores() if threads is None else threads
    with reported(ValueError):
        set_compute_threads(n)
    return n


def resolve_precision(dtype: str | None, quant: str | None, device: str, exact: bool, side: str) -> Precision:
    """--exact, an explicit --dtype/--quant (the other then from the exact mode), or the fastest here;
    said once on stderr, so a user knows what runs."""
    if exact and (dtype not in (None, "float32") or quant not in (None, "none")):
        raise typer.BadParameter("--exact is float32 compute with the checkpoint's weights: drop --dtype/--quant")
    with reported(ValueError):
        if exact:
            precision = Precision(EXACT.dtype, EXACT.quant, device)
        elif dtype is None and quant is None:
            precision = fastest(device)
        else:
            precision = Precision.parse(dtype or "float32", quant or "none", device)
    how = "exact" if precision.exact else "the fastest here" if dtype is None and quant is None else "as asked"
    typer.echo(f"{side}: {precision.name} ({how}; --exact for float32, docs/precision.md for each setting's cost)", err=True)
    return precision


def parse_setting(name: str | None) -> Precision:
    """A --setting name as a Precision; None is the fastest here."""
    if name is None:
        return fastest()
    try:
        return Precision.from_name(name)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def precision(
    dtype: Annotated[Optional[str], typer.Option(help=f"compute dtype: float32, bfloat16 or float16 (default: the fastest here; {COSTS})")] = None,
    quant: Annotated[Optional[str], typer.Option(help="weight-only quantization: none, int8 or int4 (default: the fastest here)")] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda or mps (only cpu is verified)")] = "cpu",
    exact: Annotated[bool, typer.Option("--exact", help="float32 with the checkpoint's weights: transformers' output, bit for bit")] = False,
) -> Precision:
    """The Precision a side's options describe (a group for `with_options`)."""
    return resolve_precision(dtype, quant, device, exact, "precision")


def sampling(
    sample: Annotated[bool, typer.Option("--sample/--greedy", help="sample instead of taking the argmax")] = False,
    temperature: float = 1.0,
    top_k: Annotated[int, typer.Option(help="keep the k likeliest tokens (0: all)")] = 0,
    top_p: Annotated[float, typer.Option(help="keep the likeliest tokens covering this probability")] = 1.0,
    repetition_penalty: float = 1.0,
    seed: Annotated[Optional[int], typer.Option(help="fixes the samples")] = None,
) -> Any:
    """The SamplingParams of the sampling options."""
    from splitllm.decoding.sampling import SamplingParams

    return SamplingParams(
        do_sample=sample, temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty, seed=seed
    )


def with_options(**groups: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command every option of each group (a function like `sampling`) and call it with what
    the group builds from them, under the group's name, so commands share options without copies."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        shared = {name: inspect.signature(build, eval_str=True).parameters for name, build in groups.items()}
        own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.name not in groups]
        params = own + [p for group in shared.values() for p in group.values()]

        @functools.wraps(command)
        def run(**kwargs: Any) -> Any:
            with reported(ValueError, OSError):
                built = {name: build(**{k: kwargs.pop(k) for k in shared[name]}) for name, build in groups.items()}
            return command(**kwargs, **built)

        run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run

    return decorate
