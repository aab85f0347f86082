"""The runtime's commands (serve, generate, chat, client-api, attest): wiring over the public Python API only."""

import typer

from splitllm.commands import attest_commands, client_commands, serve_commands


def register(app: typer.Typer) -> None:
    serve_commands.register(app)
    client_commands.register(app)
    attest_commands.register(app)
