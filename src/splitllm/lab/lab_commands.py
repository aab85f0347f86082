"""The lab's commands, registered on the `splitllm` command line next to the runtime's."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from splitllm.commands.options import Decode, RttMs, Setting, parse_setting
from splitllm.decoding.modes import DEFAULT_DECODE
from splitllm.lab.bench.bench_commands import app as bench_app
from splitllm.lab.privacy.privacy_commands import app as privacy_app
from splitllm.lab.training.training_commands import app as draft_app


def demo(
    prompt: Annotated[Optional[str], typer.Argument(help="what to ask")] = None,
    rtt_ms: RttMs = 80.0,
    max_new_tokens: int = 96,
    decode: Decode = DEFAULT_DECODE,
    setting: Setting = None,
) -> None:
    """Start a server, an emulated WAN link and a client on loopback; stream an answer, then compare
    its speed with sequential decoding of the same answer."""
    from splitllm.lab.data.workload import DEMO_PROMPT
    from splitllm.lab.demo import run_demo

    run_demo(prompt or DEMO_PROMPT, rtt_ms, max_new_tokens, decode, parse_setting(setting))


def netem(
    listen: Annotated[str, typer.Option(help="HOST:PORT to listen on (a bare PORT listens on 127.0.0.1)")],
    target: Annotated[str, typer.Option(help="HOST:PORT to forward to")],
    rtt_ms: Annotated[float, typer.Option(help="added round-trip time, ms")] = 80.0,
    jitter_ms: Annotated[float, typer.Option(help="jitter, ms")] = 0.0,
    bandwidth_mbit: Annotated[Optional[float], typer.Option(help="cap in Mbit/s each way")] = None,
) -> None:
    """A WAN emulator: a TCP proxy adding delay, jitter and a bandwidth cap."""
    from splitllm.testing.netem import LinkProfile, run_netem

    host, _, port = listen.rpartition(":")
    if not port.isdigit():
        raise typer.BadParameter(f"--listen takes HOST:PORT, not {listen!r}")
    run_netem(host or "127.0.0.1", int(port), target, LinkProfile(rtt_ms=rtt_ms, jitter_ms=jitter_ms, bandwidth_mbit=bandwidth_mbit))


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
    app.command("netem")(netem)
    app.add_typer(bench_app, name="bench")
    app.add_typer(privacy_app, name="privacy")
    app.add_typer(draft_app, name="draft")
