"""The client's commands: `generate`, `chat` and `client-api`, over one set of model and connection options."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from splitllm.commands.options import (
    COSTS, Decode, Head, Model, Port, Tail, Threads, WireDtype, fail, reported, resolve_precision, sampling, set_threads,
    with_options,
)
from splitllm.decoding.modes import DEFAULT_DECODE
from splitllm.model.precision import Precision


def client(
    server: Annotated[Optional[str], typer.Option(help="ws(s)://host:port of a splitllm server; omit to run in-process")] = None,
    model: Model = "default",
    head: Head = 2,
    tail: Tail = 2,
    wire_dtype: WireDtype = "float16",
    dtype: Annotated[Optional[str], typer.Option(help=f"compute dtype of the client's layers: float32, bfloat16 or float16 (default: the fastest here; {COSTS})")] = None,
    quant: Annotated[Optional[str], typer.Option(help="weight-only quantization of the client's layers: none, int8 or int4 (default: the fastest here)")] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda or mps (only cpu is verified)")] = "cpu",
    exact: Annotated[bool, typer.Option("--exact", help="float32 with the checkpoint's weights (also the in-process middle's): transformers' output, bit for bit")] = False,
    lm_head_dtype: Annotated[Optional[str], typer.Option(help="compute dtype of embedding and LM head (default: the layers')")] = None,
    lm_head_quant: Annotated[Optional[str], typer.Option(help="quantization of the LM head (default: the layers')")] = None,
    threads: Threads = None,
    token_file: Annotated[Optional[str], typer.Option(help="file holding the bearer token (default: $SPLITLLM_TOKEN)")] = None,
    ca: Annotated[Optional[str], typer.Option(help="PEM CA bundle to verify a wss:// server (self-signed setups)")] = None,
    insecure: Annotated[bool, typer.Option(help="skip wss:// certificate checks (tests only)")] = False,
    client_cert: Annotated[Optional[str], typer.Option(help="PEM client certificate for mutual TLS")] = None,
    client_key: Annotated[Optional[str], typer.Option(help="PEM key of --client-cert")] = None,
    fallback: Annotated[Optional[list[str]], typer.Option(help="another server to fail over to (repeatable)")] = None,
    reconnect_deadline_s: Annotated[float, typer.Option(help="seconds to keep trying to reach a server")] = 60.0,
    drafter: Annotated[Optional[str], typer.Option(help="drafter folder (`splitllm draft train`); default: the shipped one")] = None,
    attestation_policy: Annotated[Optional[str], typer.Option(help="JSON policy a confidential server must prove it meets before any hidden state is sent; frames are then sealed (docs/confidential.md). Without it the server's operator can read the states")] = None,
    max_context: Annotated[Optional[int], typer.Option(min=1, help="tokens a conversation may hold (default: the model's own limit; a server may grant fewer, and the caches take memory as they fill)")] = None,
    draft_model: Annotated[Optional[str], typer.Option(help="a smaller model with this one's tokenizer (an alias, folder or .gguf), run whole on the client, that drafts in place of the drafter (default: the model's packaged one, as qwen2.5-coder-0.5b for qwen2.5-coder-1.5b; none: none)")] = None,
) -> Any:
    """The SplitClient that the model and connection options of every client command describe."""
    from splitllm.client.connection import ConnectionOptions, read_token
    from splitllm.client.client import SplitClient

    set_threads(threads)
    options = ConnectionOptions(
        token=read_token(token_file), ca_file=ca, insecure=insecure, client_cert=client_cert, client_key=client_key,
        fallbacks=tuple(fallback or ()), deadline_s=reconnect_deadline_s,
    )
    layers = resolve_precision(dtype, quant, device, exact, "client precision")
    lm_head = None
    if lm_head_dtype or lm_head_quant:
        lm_head = Precision.parse(
            lm_head_dtype or layers.dtype_name, lm_head_quant or layers.quant, device
        )
    return SplitClient(
        model, server, head, tail, wire_dtype, precision=layers, lm_head_precision=lm_head, connection=options,
        drafter=drafter, draft_model=draft_model, attestation_policy=attestation_policy, max_context=max_context,
    )


@functools.wraps(client)
def served_client(**options: Any) -> tuple[Any, Any]:
    """`client`'s SplitClient built on a new ComputeThread, which then runs every generation too: the
    weights load where the steps run, so PyTorch keeps one thread pool (see threads.ComputeThread)."""
    from splitllm.threads import ComputeThread

    set_threads(options["threads"])  # before the compute thread starts: it pins a team of this size
    compute = ComputeThread()
    return compute.run(lambda: client(**options)), compute


def generate(
    client: Any,
    sampling: Any,
    prompt: str,
    max_new_tokens: int = 128,
    decode: Decode = DEFAULT_DECODE,
    stop: Annotated[Optional[list[str]], typer.Option(help="end the answer before this text (repeatable)")] = None,
    raw: Annotated[bool, typer.Option(help="skip the chat template")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object instead of streaming")] = False,
) -> None:
    """Generate text, streaming it, then a one-line summary of where the time went."""
    from splitllm.client.connection import CLIENT_ERRORS
    from splitllm.threads import compute_threads_pinned

    gen = None
    printed = ""
    try:
        with compute_threads_pinned():
            for gen, _ in client.stream(prompt, max_new_tokens, decode, not raw, sampling, stop or ()):
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
    client: Any,
    sampling: Any,
    decode: Decode = DEFAULT_DECODE,
    max_new_tokens: Annotated[int, typer.Option(help="longest answer, in tokens")] = 256,
    system: Annotated[Optional[str], typer.Option(help="system prompt")] = None,
) -> None:
    """Chat in the terminal; every turn reuses the KV cache of the conversation so far."""
    import contextlib

    from splitllm.api.terminal_chat import run_chat
    from splitllm.threads import compute_threads_pinned

    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input())
    with reported(ValueError), compute_threads_pinned():  # a base model has no chat template
        run_chat(client, decode, sampling, max_new_tokens, system)


def client_api(
    client: Any,
    host: Annotated[str, typer.Option(help="address to listen on (keep it on the trusted device)")] = "127.0.0.1",
    port: Port = 8000,
    decode: Decode = DEFAULT_DECODE,
    served_model_name: Annotated[Optional[str], typer.Option(help="the model id clients see")] = None,
    max_conversations: Annotated[int, typer.Option(min=0, help="conversations kept open so a follow-up request reads only its new tokens (0: none)")] = 8,
    max_conversation_gib: Annotated[float, typer.Option(min=0, help="client memory the kept conversations' caches may hold, GiB")] = 2.0,
    api_keys: Annotated[Optional[Path], typer.Option(help="file of API keys, one a line: every /v1 request must then carry one (Authorization: Bearer KEY), and each key's conversations are kept apart")] = None,
) -> None:
    """A local web chat at / and an OpenAI-compatible endpoint (/v1/chat/completions, /v1/completions,
    /v1/models) over the split; a request's 'decode' overrides --decode."""
    import uvicorn

    from splitllm.api.openai import create_app
    from splitllm.client.conversations import ReuseLimits

    split_client, compute = client
    where = split_client.server or "in-process middle"
    typer.echo(f"web chat on http://{host}:{port}/ and OpenAI-compatible endpoint on http://{host}:{port}/v1 ({where})", err=True)
    reuse = ReuseLimits(max_conversations, int(max_conversation_gib * (1 << 30)))
    keys = frozenset()
    if api_keys is not None:
        with reported(OSError):
            keys = frozenset(line.strip() for line in api_keys.read_text().splitlines() if line.strip())
        if not keys:
            fail(f"{api_keys} holds no API key")
    app = create_app(split_client, served_model_name, decode, compute, reuse, keys)
    uvicorn.run(app, host=host, port=port, log_level="warning")


def register(app: typer.Typer) -> None:
    app.command("generate")(with_options(client=client, sampling=sampling)(generate))
    app.command("chat")(with_options(client=client, sampling=sampling)(chat))
    app.command("client-api")(with_options(client=served_client)(client_api))
