"""The lab's commands, registered on the `splitllm` command line next to the runtime's."""

from __future__ import annotations

from typing import Annotated

import typer

from splitllm.commands.wiring import command, parse_setting
from splitllm.lab.bench.bench_commands import app as bench_app
from splitllm.lab.privacy.privacy_commands import app as privacy_app
from splitllm.lab.training.training_commands import app as drafter_app
from splitllm.options import DEMO, NETEM


def demo(
    prompt: Annotated[str | None, typer.Argument(help="what to ask")] = None, *, rtt_ms: float,
    max_new_tokens: int, decode: str, setting: str | None,
) -> None:
    """Start a server, an emulated WAN link and a client on loopback; stream an answer, then compare
    its speed with sequential decoding of the same answer."""
    from splitllm.lab.data.workload import DEMO_PROMPT
    from splitllm.lab.demo import run_demo

    run_demo(prompt or DEMO_PROMPT, rtt_ms, max_new_tokens, decode, parse_setting(setting))


def netem(listen: str, target: str, rtt_ms: float, jitter_ms: float, bandwidth_mbit: float | None) -> None:
    """A WAN emulator: a TCP proxy adding delay, jitter and a bandwidth cap."""
    from splitllm.testing.netem import LinkProfile, run_netem

    host, _, port = listen.rpartition(":")
    if not port.isdigit():
        raise typer.BadParameter(f"--listen takes HOST:PORT, not {listen!r}")
    run_netem(host or "127.0.0.1", int(port), target,
              LinkProfile(rtt_ms=rtt_ms, jitter_ms=jitter_ms, bandwidth_mbit=bandwidth_mbit))


def register(app: typer.Typer) -> None:
    command(app, DEMO)(demo)
    command(app, NETEM)(netem)
    app.add_typer(bench_app, name="bench")
    app.add_typer(privacy_app, name="privacy")
    app.add_typer(drafter_app, name="drafter")
