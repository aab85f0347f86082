"""The `splitllm` command line: the runtime's commands and the lab's, each registered by its own side.

Every option is declared once, in splitllm.options, and follows one vocabulary (docs/cli.md): durations
and sizes carry their unit (`--rtt-ms`, `--session-ttl-s`, `--max-kv-gib`), several values are
comma-separated, `--out` is a folder; every option also reads `SPLITLLM_<COMMAND>_<OPTION>` from the
environment.
"""

from __future__ import annotations

import typer

from splitllm import commands
from splitllm.lab import lab_commands

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Split LLM inference over a WAN.")
commands.register(app)
lab_commands.register(app)


def main() -> None:
    app(prog_name="splitllm")


if __name__ == "__main__":
    main()
