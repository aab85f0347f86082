"""The `splitllm` command line: the runtime's commands and the lab's, each registered by its own side.

Every option is declared once, in splitllm.options, and follows one vocabulary (docs/cli.md): durations
and sizes carry their unit (`--rtt-ms`, `--session-ttl-s`, `--max-kv-gib`), several values are
comma-separated, `--out` is a folder; a runtime command's option also reads `SPLITLLM_<OPTION>` from the
environment.

Registering a command imports no model code (each command imports what it runs), and the lab's commands
register only when asked for, so `--help`, a runtime command and a mistyped flag answer at once, and a
runtime command never imports `splitllm.lab`.
"""

from __future__ import annotations

from typing import cast

import typer
from typer.core import TyperCommand, TyperGroup

from splitllm import commands


class _Root(TyperGroup):
    """The root group: the runtime's commands from the start, the lab's (`splitllm.lab.lab_commands`) added
    the first time a name is not the runtime's or every command is listed (`splitllm --help`)."""

    lab_added = False

    def _add_lab(self) -> None:
        if self.lab_added:
            return
        from splitllm.lab import lab_commands

        lab = typer.Typer()
        lab_commands.register(lab)
        every = {**self.commands, **typer.main.get_group(lab).commands}
        # typer's own order, as if both sides were registered on one app: the commands, then the groups
        self.commands = {name: every[name] for name in sorted(every, key=lambda n: isinstance(every[n], TyperGroup))}
        self.lab_added = True

    # typer types the base methods' ctx as the Context of the click it vendors (private), typer.Context's base.
    def get_command(self, ctx: typer.Context, cmd_name: str) -> TyperCommand | TyperGroup | None:  # type: ignore[override]
        if cmd_name not in self.commands:
            self._add_lab()
        return cast("TyperCommand | TyperGroup | None", super().get_command(ctx, cmd_name))  # typer's commands

    def list_commands(self, ctx: typer.Context) -> list[str]:  # type: ignore[override]
        self._add_lab()
        return super().list_commands(ctx)


app = typer.Typer(cls=_Root, add_completion=False, no_args_is_help=True, help="Split LLM inference over a WAN.")
commands.register(app)


def main() -> None:
    app(prog_name="splitllm")


if __name__ == "__main__":
    main()
