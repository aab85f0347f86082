"""The client's commands: `generate`, `chat` and `client-api`, over one set of model and connection options."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from splitllm.commands.wiring import AskedPrecision, command, fail, reported, sampling, set_threads
from splitllm.options import CHAT, CLIENT_API, GENERATE, Split, defaults_of

_CLIENT = defaults_of(GENERATE)


@dataclass(frozen=True, kw_only=True)
class ClientSettings:
    """The model and connection options of every client command besides the split and the precision
    (`open_client` makes a SplitClient of them); the defaults are the commands' (splitllm.options)."""

    server: str | None = _CLIENT["server"]  # None: the middle runs in this process
    wire_dtype: str = _CLIENT["wire_dtype"]
    threads: int | None = _CLIENT["threads"]
    lm_head_dtype: str | None = _CLIENT["lm_head_dtype"]
    lm_head_quant: str | None = _CLIENT["lm_head_quant"]
    token_file: str | None = _CLIENT["token_file"]
    ca: str | None = _CLIENT["ca"]
    insecure: bool = _CLIENT["insecure"]
    client_cert: str | None = _CLIENT["client_cert"]
    client_key: str | None = _CLIENT["client_key"]
    fallback: list[str] | None = _CLIENT["fallback"]
    reconnect_deadline_s: float = _CLIENT["reconnect_deadline_s"]
    drafter: str | None = _CLIENT["drafter"]
    draft_model: str | None = _CLIENT["draft_model"]
    attestation_policy: str | None = _CLIENT["attestation_policy"]
    max_context: int | None = _CLIENT["max_context"]


def open_client(split: Split, client: ClientSettings, precision: AskedPrecision) -> Any:
    """The SplitClient that a client command's options describe."""
    from splitllm.client.connection import ConnectionOptions, read_token
    from splitllm.client.client import SplitClient
    from splitllm.model.precision import Precision

    set_threads(client.threads)
    options = ConnectionOptions(
        token=read_token(client.token_file), ca_file=client.ca, insecure=client.insecure,
        client_cert=client.client_cert,
        client_key=client.client_key, fallbacks=tuple(client.fallback or ()), deadline_s=client.reconnect_deadline_s,
    )
    layers = precision.resolve("client precision")
    lm_head = None
    if client.lm_head_dtype or client.lm_head_quant:
        lm_head = Precision.parse(
            client.lm_head_dtype or layers.dtype_name, client.lm_head_quant or layers.quant, precision.device
        )
    return SplitClient(
        split.model, client.server, split.first, split.last, client.wire_dtype, precision=layers,
        lm_head_precision=lm_head, connection=options, drafter=client.drafter, draft_model=client.draft_model,
        attestation_policy=client.attestation_policy, max_context=client.max_context,
    )


def served_client(split: Split, client: ClientSettings, precision: AskedPrecision) -> tuple[Any, Any]:
    """`open_client`'s SplitClient built on a new ComputeThread, which then runs every generation too: the
    weights load where the steps run, so PyTorch keeps one thread pool (see threads.ComputeThread)."""
    from splitllm.threads import ComputeThread

    set_threads(client.threads)  # before the compute thread starts: it pins a team of this size
    compute = ComputeThread()
    return compute.run(lambda: open_client(split, client, precision)), compute


def generate(
    prompt: Annotated[str, typer.Argument(help="what to ask")],
    split: Split, client: ClientSettings, precision: AskedPrecision, sampling: Any,
    max_new_tokens: int, decode: str, stop: list[str] | None, raw: bool, as_json: bool,
) -> None:
    """Generate text, streaming it, then a one-line summary of where the time went."""
    from splitllm.client.connection import CLIENT_ERRORS
    from splitllm.threads import compute_threads_pinned

    with reported(ValueError, OSError):
        split_client = open_client(split, client, precision)
    gen = None
    printed = ""
    try:
        with compute_threads_pinned():
            for gen, _ in split_client.stream(prompt, max_new_tokens, decode, not raw, sampling, stop or ()):
                if not as_json:
                    sys.stdout.write(gen.text[len(printed) :])
                    sys.stdout.flush()
                    printed = gen.text
    except CLIENT_ERRORS as exc:
        typer.echo("", err=True)
        fail(exc, code=1)
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


def chat(
    split: Split, client: ClientSettings, precision: AskedPrecision, sampling: Any, decode: str, max_new_tokens: int,
    system: str | None,
) -> None:
    """Chat in the terminal; every turn reuses the KV cache of the conversation so far."""
    import contextlib

    from splitllm.api.terminal_chat import run_chat
    from splitllm.threads import compute_threads_pinned

    with reported(ValueError, OSError):
        split_client = open_client(split, client, precision)
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input())
    with reported(ValueError), compute_threads_pinned():  # a base model has no chat template
        run_chat(split_client, decode, sampling, max_new_tokens, system)


def client_api(
    split: Split, client: ClientSettings, precision: AskedPrecision, host: str, port: int, decode: str,
    served_model_name: str | None, max_conversations: int, max_conversation_gib: float, suffix_tokens: int,
    api_keys: Path | None,
) -> None:
    """A local web chat at / and an OpenAI-compatible endpoint (/v1/chat/completions, /v1/completions,
    /v1/models) over the split; a request's 'decode' overrides --decode."""
    import uvicorn

    from splitllm.api.openai import create_app
    from splitllm.client.conversations import ReuseLimits

    with reported(ValueError, OSError):
        split_client, compute = served_client(split, client, precision)
    where = split_client.server or "in-process middle"
    typer.echo(f"web chat on http://{host}:{port}/ and OpenAI-compatible endpoint on http://{host}:{port}/v1 ({where})",
               err=True)
    reuse = ReuseLimits(max_conversations, int(max_conversation_gib * (1 << 30)), suffix_tokens=suffix_tokens)
    keys: frozenset[str] = frozenset()
    if api_keys is not None:
        with reported(OSError):
            keys = frozenset(line.strip() for line in api_keys.read_text().splitlines() if line.strip())
        if not keys:
            fail(f"{api_keys} holds no API key")
    app = create_app(split_client, served_model_name, decode, compute, reuse, keys)
    uvicorn.run(app, host=host, port=port, log_level="warning")


def register(app: typer.Typer) -> None:
    for name, function in ((GENERATE, generate), (CHAT, chat)):
        command(app, name, split=Split, client=ClientSettings, precision=AskedPrecision, sampling=sampling)(function)
    command(app, CLIENT_API, split=Split, client=ClientSettings, precision=AskedPrecision)(client_api)
