"""The command line's vocabulary: every option declared once in the option table (the commands' options,
their environment variables and docs/cli.md generated from it), decoding modes offered and checked up
front, the precision each side runs chosen and said at start, clear errors, small command functions, and
help and parsing that load neither the model code nor the lab."""

from __future__ import annotations

import ast
import inspect
import importlib.metadata
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from splitllm import options as table
from splitllm.cli import app
from splitllm.client.connection import TOKEN_ENV
from splitllm.commands.wiring import need_extra, resolve_precision
from splitllm.lab import results
from splitllm.model.precision import EXACT, fastest
from splitllm.decoding.mode_names import DEFAULT_DECODE
from splitllm.decoding.modes import DECODERS
from splitllm.kernels.cpu_kernels import SWITCH

SRC = Path(__file__).resolve().parents[1] / "src" / "splitllm"
WIDE = {"COLUMNS": "400"}  # rich wraps nothing, so an error's words stay on one line
COMMAND_FILES = [*sorted((SRC / "commands").glob("*.py")), SRC / "cli.py",
                 *sorted((SRC / "lab").rglob("*_commands.py"))]


def _help(command: list[str]) -> str:
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0
    return result.output


@pytest.mark.parametrize("command", [["generate"], ["chat"], ["client-api"], ["demo"]])
def test_decode_lists_the_registrys_modes_and_defaults_to_auto(command: list[str]) -> None:
    text = _help(command)
    assert "|".join(DECODERS) in text and f"[default: {DEFAULT_DECODE}]" in text


def test_an_unknown_mode_is_refused_before_anything_loads() -> None:
    t0 = time.perf_counter()
    result = CliRunner().invoke(app, ["generate", "hello", "--decode", "fast", "--model", "/nonexistent"])
    assert result.exit_code == 2 and "fast" in result.output and "sequential" in result.output
    assert time.perf_counter() - t0 < 5  # parsed and refused, not loaded


@pytest.mark.parametrize("option", ["--slice-rows", "--slice-above", "--max-batch-rows", "--max-nodes-per-step"])
def test_server_limits_below_one_are_refused_before_anything_loads(option: str) -> None:
    result = CliRunner().invoke(app, ["serve", option, "0", "--model", "/nonexistent"], env={"COLUMNS": "400"})
    assert result.exit_code == 2 and "must be at least 1" in result.output


@pytest.mark.parametrize("command", [["generate", "hello"], ["chat"], ["client-api"], ["bench", "speculation"]])
def test_a_wire_dtype_the_protocol_lacks_is_refused_before_anything_loads(command: list[str]) -> None:
    result = CliRunner().invoke(app, [*command, "--wire-dtype", "int8", "--model", "/nonexistent"],
                                env={"COLUMNS": "400"})
    assert result.exit_code == 2 and "Invalid value for '--wire-dtype'" in result.output and "bfloat16" in result.output


@pytest.mark.parametrize("command", ["serve", "client-api"])
@pytest.mark.parametrize("port", ["0", "65536", "99999"])
def test_a_port_outside_1_to_65535_is_refused_before_anything_loads(command: str, port: str) -> None:
    result = CliRunner().invoke(app, [command, "--port", port, "--model", "/nonexistent"], env={"COLUMNS": "400"})
    assert result.exit_code == 2 and "Invalid value for '--port'" in result.output


def test_a_continued_drafter_with_another_width_is_refused_before_anything_loads() -> None:
    args = ["drafter", "train", "--init", "shipped", "--intermediate", "4608", "--out", "/nonexistent/drafter"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "400"})
    assert result.exit_code == 2 and "keeps its width" in result.output


@pytest.mark.parametrize("attestation", ["sev-snp", "tdx", "simulated"])
def test_ray_replicas_are_never_attested(attestation: str) -> None:
    """Ray runs code its driver ships and lets any client of the cluster call a replica's methods, which no
    measurement covers: the pair is refused, saying why, before Ray or the model is touched."""
    t0 = time.perf_counter()
    args = ["serve", "--engine", "ray", "--attestation", attestation, "--attestation-sim", "/nonexistent",
            "--model", "/nonexistent"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "1000"})
    assert result.exit_code == 2 and "--attestation needs --engine uvicorn" in result.output
    assert "Ray runs code its driver ships" in result.output and "call a replica's methods" in result.output
    assert time.perf_counter() - t0 < 5


def test_tls_files_that_do_not_load_are_refused_before_the_model_loads(  # type: ignore[no-untyped-def]
    tmp_path
) -> None:
    (tmp_path / "bad.pem").write_text("not a certificate\n")
    for cert in (str(tmp_path / "bad.pem"), str(tmp_path / "missing.pem")):
        args = ["serve", "--tls-cert", cert, "--tls-key", cert, "--model", "/nonexistent"]
        result = CliRunner().invoke(app, args, env={"COLUMNS": "400"})
        assert result.exit_code == 2 and f"the TLS files do not load (--tls-cert {cert}" in result.output


def test_client_tls_files_that_do_not_load_are_refused_not_retried(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "bad.pem").write_text("not a certificate\n")
    for option in ("--ca", "--client-cert"):
        t0 = time.perf_counter()
        args = ["generate", "hi", "--server", "wss://127.0.0.1:9", option, str(tmp_path / "bad.pem"), "--model",
                "/nonexistent"]
        result = CliRunner().invoke(app, args, env={"COLUMNS": "400"})
        assert result.exit_code == 2 and f"the TLS files do not load ({option} {tmp_path / 'bad.pem'}" in result.output
        assert time.perf_counter() - t0 < 5  # refused, not retried until the deadline


def test_the_default_precision_is_the_fastest_here_and_said_once(capsys: pytest.CaptureFixture[str]) -> None:
    chosen = resolve_precision(None, None, "cpu", False, "precision")
    assert chosen == fastest()
    err = capsys.readouterr().err
    assert err.count(chosen.name) == 1 and "the fastest here" in err and "--exact" in err


def test_exact_is_float32_without_quantization_and_refuses_a_contradiction() -> None:
    assert resolve_precision(None, None, "cpu", True, "precision") == EXACT
    assert resolve_precision("float32", "none", "cpu", False, "precision") == EXACT
    with pytest.raises(typer.BadParameter, match="--exact"):
        resolve_precision("bfloat16", None, "cpu", True, "precision")


def test_an_explicit_dtype_fills_the_rest_from_the_exact_mode() -> None:
    assert resolve_precision("bfloat16", None, "cpu", False, "p").name == "bfloat16-none"
    assert resolve_precision(None, "int8", "cpu", False, "p").name == "float32-int8"


def test_an_option_reads_one_variable_in_every_runtime_command_and_none_in_the_lab() -> None:
    """`SPLITLLM_<OPTION>` in whichever runtime command takes the option; a lab command reads none, since its
    results record the command line that made them."""
    assert "SPLITLLM_PORT" in _help(["serve"]) and "SPLITLLM_THREADS" in _help(["generate"])
    for command in ("serve", "client-api"):
        result = CliRunner().invoke(app, [command, "--model", "/nonexistent"], env={"SPLITLLM_PORT": "0", **WIDE})
        assert result.exit_code == 2 and "Invalid value for '--port'" in result.output, command
    result = CliRunner().invoke(app, ["serve", "--model", "/nonexistent"], env={"SPLITLLM_SLICE_ROWS": "0", **WIDE})
    assert result.exit_code == 2 and "must be at least 1" in result.output
    assert "SPLITLLM_" not in _help(["bench", "speculation"])


def test_one_variable_per_option_name_with_one_meaning() -> None:
    """A name the runtime takes in several commands measures one thing in all of them, and no option's
    variable is one the runtime reads for itself."""
    runtime = [o for o in table.OPTIONS if set(o.commands) & set(table.RUNTIME)]
    units: dict[str, set[str]] = {}
    for o in runtime:
        units.setdefault(o.name, set()).add(o.unit)
    assert all(len(u) == 1 for u in units.values()), units
    variables = {o.env for o in runtime}
    assert len(variables) == len(units)
    assert variables.isdisjoint({"SPLITLLM_CACHE", TOKEN_ENV, SWITCH, "SPLITLLM_TILES"})


def test_a_missing_extra_names_what_is_missing_and_the_install_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    need_extra("privacy")  # installed for the tests: nothing to say
    assert capsys.readouterr().err == ""
    real = importlib.metadata.distribution

    def without_scipy(name: str) -> importlib.metadata.Distribution:
        if name == "scipy":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", without_scipy)  # matplotlib stays: scipy must be named
    with pytest.raises(typer.Exit):
        need_extra("privacy")
    err = capsys.readouterr().err
    assert "scipy missing" in err and "pip install 'splitllm[privacy]'" in err


def _commands(group: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    """Every command under a (typer's own click) group, by the words that run it (listing the root adds the lab's)."""
    ctx = typer.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        if hasattr(cmd, "commands"):
            yield from _commands(cmd, (*path, name))
        else:
            yield " ".join((*path, name)), cmd


def test_every_option_of_every_command_comes_from_the_table_with_its_environment_variable() -> None:
    """No option is declared outside splitllm.options, and every table entry is some command's option."""
    taken = set()
    for path, cmd in _commands(typer.main.get_command(app)):
        cli = {p.name: p for p in cmd.params if p.param_type_name == "option" and p.name != "help"}
        assert sorted(cli) == sorted(o.name for o in table.options_of(path)), path
        for name, param in cli.items():
            option = table.option(path, name)
            assert param.envvar == option.env_in(path) and param.opts[0] == option.flag.split("/")[0], (path, name)
            taken.add((path, name))
    assert taken == {(c, o.name) for c in table.COMMANDS for o in table.options_of(c)}
    assert {c for c, _ in taken} == set(table.COMMANDS)


def test_the_python_apis_defaults_are_the_client_commands() -> None:
    """What a library user gets without an argument is what `splitllm generate` runs without its option."""
    from splitllm.api.hf import GenerationConfig, SplitModelForCausalLM
    from splitllm.client.client import Conversation, SplitClient

    generate = table.defaults_of(table.GENERATE)
    apis = (SplitClient, SplitClient.generate, SplitClient.stream, Conversation.stream,
            SplitModelForCausalLM.from_pretrained, GenerationConfig)
    checked = set()
    for api in apis:
        for name, parameter in inspect.signature(api).parameters.items():
            if name in generate and name != "model" and parameter.default is not inspect.Parameter.empty:
                want = generate[name]
                assert parameter.default == want or not (parameter.default or want), (api, name)  # () is no stop
                checked.add(name)
    assert {"first", "last", "wire_dtype", "max_new_tokens", "max_context"} <= checked


def test_no_command_takes_two_options_of_one_name_and_units_are_in_the_names() -> None:
    for command in table.COMMANDS:
        names = [o.name for o in table.options_of(command)]
        assert len(names) == len(set(names)), command
    suffixes = {"ms": "_ms", "s": "_s", "GiB": "_gib", "MiB": "_mib", "KiB": "_kib", "Mbit/s": "_mbit"}
    for option in table.OPTIONS:
        assert option.name.endswith(suffixes.get(option.unit, "")), option.name


def test_the_committed_option_lists_in_docs_cli_md_are_the_tables() -> None:
    doc = results.CHECKOUT / "docs" / "cli.md"
    assert results.block(doc.read_text(), "options") == table.markdown(), (
        "regenerate: results.update_doc(docs/cli.md, 'options', splitllm.options.markdown())"
    )


@pytest.mark.parametrize("path", COMMAND_FILES, ids=lambda p: str(p.relative_to(SRC)))
def test_command_functions_are_small(path: Path) -> None:
    """A command takes a few records, not a long list of options: at most 12 parameters and 60 lines."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            count = len(args.posonlyargs + args.args + args.kwonlyargs) + bool(args.vararg) + bool(args.kwarg)
            lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            assert count <= 12 and lines <= 60, f"{node.name}: {count} parameters, {lines} lines"


def _in_a_fresh_interpreter(*invocations: list[str]) -> tuple[list[tuple[int, str]], set[str]]:
    """Each invocation's exit code and output, run in turn by a new Python that imports only the CLI, and which
    of torch, transformers, numpy and the lab it had imported by the end."""
    code = (
        "import json, sys; from typer.testing import CliRunner; from splitllm.cli import app; "
        f"runs = [CliRunner().invoke(app, a, env={{'COLUMNS': '400'}}) for a in {list(invocations)!r}]; "
        "heavy = [m for m in ('torch', 'transformers', 'numpy', 'splitllm.lab') if m in sys.modules]; "
        "print(json.dumps([[[r.exit_code, r.output] for r in runs], heavy]))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    runs, heavy = json.loads(run.stdout)
    return [tuple(r) for r in runs], set(heavy)


def test_help_and_a_mistyped_flag_answer_without_loading_torch_or_transformers() -> None:
    """The model code loads when a command runs, not to list the commands, show one's options or refuse a flag."""
    runs, heavy = _in_a_fresh_interpreter(["--help"], ["generate", "--help"], ["serve", "--help"],
                                          ["generate", "hi", "--bogus"])
    assert [code for code, _ in runs] == [0, 0, 0, 2]
    (_, root), (_, generate), (_, serve), (_, bogus) = runs
    assert all(name in root for name in ("generate", "serve", "attest", "bench", "privacy", "drafter"))
    assert "|".join(DECODERS) in generate and "SPLITLLM_DECODE" in generate
    assert "SPLITLLM_MAX_KV_GIB" in serve and "No such option: --bogus" in bogus
    assert not heavy & {"torch", "transformers", "numpy"}, heavy


def test_the_runtimes_commands_never_import_the_lab() -> None:
    runs, heavy = _in_a_fresh_interpreter(
        ["generate", "--help"], ["serve", "--help"], ["chat", "--bogus"], ["attest", "sim-init", "--help"],
        ["client-api", "--port", "0"],
    )
    assert [code for code, _ in runs] == [0, 0, 2, 0, 2]
    assert "splitllm.lab" not in heavy


def test_a_mistyped_command_is_matched_against_the_labs_commands_too() -> None:
    result = CliRunner().invoke(app, ["benh"], env={"COLUMNS": "400"})
    assert result.exit_code == 2 and "Did you mean 'bench'?" in result.output
