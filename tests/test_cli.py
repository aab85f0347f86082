"""The command line's vocabulary: decoding modes offered and checked up front, deprecated spellings."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from splitllm.cli import DEPRECATED, app, upgrade_argv
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


def test_old_spellings_become_new_ones_with_a_notice() -> None:
    notices: list[str] = []
    argv = ["bench", "sweep", "--points", "0,80", "--per-category=2", "--quiet-deadline", "5", "--merge"]
    assert upgrade_argv(argv, notices.append) == [
        "bench", "sweep", "--links", "0,80", "--prompts-per-category=2", "--quiet-deadline-min", "5", "--merge",
    ]
    assert len(notices) == 3 and "--quiet-deadline-s" in notices[2]
    served = upgrade_argv(["serve", "--wire-dtype", "float16", "--session-ttl", "9", "--port", "1"], notices.append)
    assert served == ["serve", "--session-ttl-s", "9", "--port", "1"] and "ignored" in notices[3]
    # Only where the old name meant it: `generate --wire-dtype` is current, `--rtt` is not a client option.
    assert upgrade_argv(["generate", "x", "--wire-dtype", "bfloat16"], notices.append)[2] == "--wire-dtype"


def test_every_new_spelling_is_an_option_of_its_command() -> None:
    for (path, _old), new in DEPRECATED.items():
        if new is None:
            continue
        hidden = new in ("--quiet-deadline-min",)
        assert hidden or new in _help(list(path)), (path, new)


def test_the_entry_point_upgrades_old_spellings() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "splitllm.cli", "netem", "--rtt", "5", "--help"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0 and "--rtt is deprecated; use --rtt-ms" in run.stderr and "--listen" in run.stdout


@pytest.mark.parametrize("option", ["--slice-rows", "--slice-above", "--max-batch-rows", "--max-nodes-per-step"])
def test_server_limits_below_one_are_refused_before_anything_loads(option: str) -> None:
    result = CliRunner().invoke(app, ["serve", option, "0", "--model", "/nonexistent"], env={"COLUMNS": "400"})
    assert result.exit_code == 2 and "must be at least 1" in result.output
