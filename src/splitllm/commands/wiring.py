"""How a command gets its options from the table (`splitllm.options`), and the helpers every command's
wiring uses.

`command` registers a function as a command: its typer signature is generated from the table's options
for that command, each reading its environment variable in a runtime command (`SPLITLLM_<OPTION>`, shown
in `--help`). The function takes a few records (`Split`, `AskedPrecision`, `ClientSettings`, ...) built
from the options of their group, the rest of its options by name, and its positional arguments
(`typer.Argument`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import inspect
from collections.abc import Callable, Iterator
from types import MappingProxyType
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, get_args

import typer
from typer.models import ArgumentInfo

from splitllm.options import REQUIRED, SERVE, Option, defaults_of, options_of

if TYPE_CHECKING:  # imported where used: registering and parsing a command loads no torch
    from splitllm.model.precision import Precision

Function = Callable[..., Any]


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
    from splitllm.model.precision import EXACT, Precision, asked

    if exact and (dtype not in (None, "float32") or quant not in (None, "none")):
        raise typer.BadParameter("--exact is float32 compute with the checkpoint's weights: drop --dtype/--quant")
    with reported(ValueError):
        if exact:
            precision = Precision(EXACT.dtype, EXACT.quant, device)
        else:
            precision = asked(None if dtype is None else Precision.parse(dtype).dtype, quant, device)
    how = "exact" if precision.exact else "the fastest here" if dtype is None and quant is None else "as asked"
    typer.echo(f"{side}: {precision.name} ({how}; --exact for float32, docs/precision.md for each setting's cost)",
               err=True)
    return precision


def parse_setting(name: str | None) -> Precision:
    """A --setting name as a Precision; None is the fastest here."""
    from splitllm.model.precision import Precision, fastest

    if name is None:
        return fastest()
    try:
        return Precision.from_name(name)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


_PRECISION = defaults_of(SERVE)


@dataclasses.dataclass(frozen=True)
class AskedPrecision:
    """What a side's --dtype, --quant, --device and --exact ask for; `resolve` picks what runs and says it."""

    dtype: str | None = _PRECISION["dtype"]
    quant: str | None = _PRECISION["quant"]
    device: str = _PRECISION["device"]
    exact: bool = _PRECISION["exact"]

    def resolve(self, side: str) -> Precision:
        return resolve_precision(self.dtype, self.quant, self.device, self.exact, side)


def sampling(sample: bool, temperature: float, top_k: int, top_p: float, repetition_penalty: float,
             seed: int | None) -> Any:
    """The SamplingParams of the sampling options."""
    from splitllm.decoding.sampling import SamplingParams

    return SamplingParams(
        do_sample=sample, temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
        seed=seed
    )


class Values:
    """A command's own options of one group by name (`values.rtt_ms`), for a command that takes more
    options than a signature should list; read-only."""

    def __init__(self, **values: Any) -> None:
        object.__setattr__(self, "_values", MappingProxyType(values))

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        raise AttributeError(f"{name} is read-only")

    def __repr__(self) -> str:
        return f"Values({', '.join(f'{k}={v!r}' for k, v in self._values.items())})"


def _parameter(option: Option, command: str, panel: str | None) -> inspect.Parameter:
    """The typer option of `option` in `command`."""
    info = typer.Option(*option.flags, help=option.help, envvar=option.env_in(command), min=option.min, max=option.max,
                        rich_help_panel=panel)
    default = option.default_for(command)
    return inspect.Parameter(
        option.name, inspect.Parameter.KEYWORD_ONLY, annotation=Annotated[option.type, info],
        default=inspect.Parameter.empty if default is REQUIRED else default,
    )


def _is_argument(parameter: inspect.Parameter) -> bool:
    return any(isinstance(a, ArgumentInfo) for a in get_args(parameter.annotation)[1:])


def _takes(build: Function, names: list[str]) -> bool:
    try:
        inspect.signature(build).bind(**dict.fromkeys(names))
    except TypeError:
        return False
    return True


def with_options(command: str, **records: Function) -> Callable[[Function], Function]:
    """Give `function` the table's options of `command`: each keyword names a parameter that receives
    what its builder makes of the options of that group (`Option.group`); the function's other
    parameters are the rest of the options, by name, and its `typer.Argument`s."""

    def decorate(function: Function) -> Function:
        options = options_of(command)
        grouped = {name: [o.name for o in options if o.group == name] for name in records}
        by_name = {o.name for o in options if o.group not in records}
        own = inspect.signature(function, eval_str=True).parameters
        arguments = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for name, p in own.items()
                     if name not in records and name not in by_name]
        mismatched = sorted((by_name | set(records)) - set(own)) + [p.name for p in arguments if not _is_argument(p)]
        mismatched += [name for name, names in grouped.items() if not names or not _takes(records[name], names)]
        if mismatched:
            raise TypeError(f"{function.__name__} and the options of `splitllm {command}` disagree on {mismatched}")
        params = arguments + [_parameter(o, command, o.group.capitalize() if o.group in records else None)
                              for o in options]

        @functools.wraps(function)
        def run(**values: Any) -> Any:
            with reported(ValueError, OSError):
                built = {name: build(**{n: values.pop(n) for n in grouped[name]}) for name, build in records.items()}
            return function(**values, **built)

        run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run

    return decorate


def command(app: typer.Typer, name: str, **records: Function) -> Callable[[Function], Function]:
    """Register the decorated function as `splitllm NAME` on `app` (whose place the name's last word
    takes), with the options `with_options` gives it; the function itself is returned unchanged."""

    def register(function: Function) -> Function:
        app.command(name.rsplit(" ", 1)[-1])(with_options(name, **records)(function))
        return function

    return register
