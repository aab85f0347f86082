"""Command line: wiring only; every command calls the public Python API."""

from __future__ import annotations

import json
import logging
import sys
from typing import Annotated, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Split LLM inference over a WAN.")

_DTYPES = {"float32", "bfloat16"}


def _torch_dtype(name: str):  # type: ignore[no-untyped-def]
    import torch

    if name not in _DTYPES:
        raise typer.BadParameter(f"compute dtype must be one of {', '.join(sorted(_DTYPES))}")
    return getattr(torch, name)


def _threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


@app.command()
def serve(
    model: Annotated[str, typer.Option(help="'default', an HF folder or a .gguf file")] = "default",
    head: Annotated[int, typer.Option(help="layers the client runs first")] = 2,
    tail: Annotated[int, typer.Option(help="layers the client runs last")] = 2,
    host: str = "127.0.0.1",
    port: int = 8765,
    wire_dtype: Annotated[str, typer.Option(help="accepted for symmetry; each session picks its own")] = "float16",
    dtype: Annotated[str, typer.Option(help="compute dtype")] = "float32",
    max_context: int = 4096,
    max_sessions: int = 64,
    session_ttl: Annotated[float, typer.Option(help="idle seconds before a session is dropped")] = 600.0,
    threads: Annotated[int, typer.Option(help="compute threads")] = 1,
) -> None:
    """Run the middle layers behind a WebSocket endpoint (never loads embedding or LM head)."""
    import uvicorn

    from splitllm.server.app import MiddleServer, ServerSettings, create_app
    from splitllm.wire import WIRE_DTYPES

    if wire_dtype not in WIRE_DTYPES:
        raise typer.BadParameter(f"wire dtype must be one of {', '.join(WIRE_DTYPES)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _threads(threads)
    settings = ServerSettings(head, tail, _torch_dtype(dtype), max_context, max_sessions, session_ttl)
    try:
        server = MiddleServer(model, settings)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"serving layers [{server.start}, {server.end}) on ws://{host}:{port}/ws", err=True)
    uvicorn.run(create_app(server), host=host, port=port, ws_per_message_deflate=False, log_level="warning")


@app.command()
def generate(
    prompt: str,
    server: Annotated[Optional[str], typer.Option(help="ws://host:port of a splitllm server; omit to run in-process")] = None,
    model: str = "default",
    head: int = 2,
    tail: int = 2,
    max_new_tokens: int = 128,
    decode: Annotated[str, typer.Option(help="decoding mode")] = "sequential",
    wire_dtype: str = "float16",
    dtype: str = "float32",
    raw: Annotated[bool, typer.Option(help="skip the chat template")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object instead of streaming")] = False,
    threads: int = 1,
) -> None:
    """Generate text, streaming it, then a one-line summary of where the time went."""
    from splitllm.client.remote import ServerError
    from splitllm.client.session import SplitClient

    _threads(threads)
    try:
        client = SplitClient(model, server, head, tail, wire_dtype, dtype=_torch_dtype(dtype))
        gen = None
        printed = ""
        for gen, _ in client.stream(prompt, max_new_tokens, decode, chat=not raw):
            if not as_json:
                text = client.tokenizer.decode(gen.ids, skip_special_tokens=True)
                sys.stdout.write(text[len(printed) :])
                sys.stdout.flush()
                printed = text
    except (ValueError, ServerError, OSError) as exc:
        typer.echo(f"\nerror: {exc}", err=True)
        raise typer.Exit(1) from None
    assert gen is not None
    summary = gen.summary()
    if as_json:
        typer.echo(json.dumps(summary))
        return
    m = summary["mean_step"]
    typer.echo(
        f"\n[{summary['new_tokens']} tokens, {summary['tokens_per_second']:.2f} tok/s, "
        f"{summary['tokens_per_step']:.2f} tok/step; mean step {m.get('total_ms', 0):.1f} ms = "
        f"client {m.get('client_ms', 0):.1f} + network {m.get('network_ms', 0):.1f} + "
        f"server {m.get('server_ms', 0):.1f}]",
        err=True,
    )


@app.command()
def netem(
    listen: Annotated[int, typer.Option(help="port to listen on")],
    target: Annotated[str, typer.Option(help="HOST:PORT to forward to")],
    rtt: Annotated[float, typer.Option(help="added round-trip time, ms")] = 80.0,
    jitter: Annotated[float, typer.Option(help="jitter, ms")] = 0.0,
    bandwidth: Annotated[Optional[float], typer.Option(help="cap in Mbit/s each way")] = None,
    host: str = "127.0.0.1",
) -> None:
    """A WAN emulator: a TCP proxy adding delay, jitter and a bandwidth cap."""
    from splitllm.netem import LinkProfile, run_netem

    run_netem(host, listen, target, LinkProfile(rtt_ms=rtt, jitter_ms=jitter, bandwidth_mbit=bandwidth))


if __name__ == "__main__":
    app()
