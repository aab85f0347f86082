"""The command line's vocabulary: decoding modes offered and checked up front, the precision each side
runs chosen and said at start, every option's environment variable, and clear errors."""

from __future__ import annotations

import importlib.metadata
import time

import pytest
import typer
from typer.testing import CliRunner

from splitllm.cli import app
from splitllm.commands.options import need_extra, resolve_precision
from splitllm.model.precision import EXACT, fastest
from splitllm.decoding.modes import DECODERS, DEFAULT_DECODE


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
    result = CliRunner().invoke(app, [*command, "--wire-dtype", "int8", "--model", "/nonexistent"], env={"COLUMNS": "400"})
    assert result.exit_code == 2 and "Invalid value for '--wire-dtype'" in result.output and "bfloat16" in result.output


@pytest.mark.parametrize("command", ["serve", "client-api"])
@pytest.mark.parametrize("port", ["0", "65536", "99999"])
def test_a_port_outside_1_to_65535_is_refused_before_anything_loads(command: str, port: str) -> None:
    result = CliRunner().invoke(app, [command, "--port", port, "--model", "/nonexistent"], env={"COLUMNS": "400"})
    assert result.exit_code == 2 and "Invalid value for '--port'" in result.output


def test_a_continued_head_with_another_width_is_refused_before_anything_loads() -> None:
    args = ["draft", "train", "--init", "shipped", "--intermediate", "4608", "--out", "/nonexistent/head"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "400"})
    assert result.exit_code == 2 and "keeps its width" in result.output


def test_tls_files_that_do_not_load_are_refused_before_the_model_loads(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "bad.pem").write_text("not a certificate\n")
    for cert in (str(tmp_path / "bad.pem"), str(tmp_path / "missing.pem")):
        args = ["serve", "--tls-cert", cert, "--tls-key", cert, "--model", "/nonexistent"]
        result = CliRunner().invoke(app, args, env={"COLUMNS": "400"})
        assert result.exit_code == 2 and f"the TLS files do not load (--tls-cert {cert}" in result.output


def test_client_tls_files_that_do_not_load_are_refused_not_retried(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "bad.pem").write_text("not a certificate\n")
    for option in ("--ca", "--client-cert"):
        t0 = time.perf_counter()
        args = ["generate", "hi", "--server", "wss://127.0.0.1:9", option, str(tmp_path / "bad.pem"), "--model", "/nonexistent"]
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


def test_every_option_reads_its_environment_variable() -> None:
    text = _help(["serve"])
    assert "SPLITLLM_SERVE_PORT" in text and "SPLITLLM_SERVE_THREADS" in text
    result = CliRunner().invoke(app, ["serve", "--model", "/nonexistent"], env={"SPLITLLM_SERVE_SLICE_ROWS": "0"})
    assert result.exit_code == 2 and "must be at least 1" in result.output
    assert "SPLITLLM_BENCH_SPECULATION_RTT_MS" in _help(["bench", "speculation"])


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
