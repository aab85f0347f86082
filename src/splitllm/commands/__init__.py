"""The runtime's commands (serve, generate, chat, client-api, attest): wiring over the public Python API only."""

import typer

from splitllm.commands import attest, client, serve


def register(app: typer.Typer) -> None:
    serve.register(app)
    client.register(app)
    attest.register(app)
