"""Command line: wiring only; every command calls the public Python API.

Names follow one vocabulary (docs/cli.md): durations and sizes carry their unit (`--rtt-ms`,
`--session-ttl-s`, `--max-kv-gib`), several values are comma-separated, `--out` is a folder.
"""

from __future__ import annotations

import functools
import inspect
import json
import sys
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal, Optional

import typer

from splitllm.decoding.modes import DECODERS, DEFAULT_DECODE

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Split LLM inference over a WAN.")

# `--decode`: the registry's modes, listed in --help and checked before anything loads.
DecodeMode = Literal[tuple(DECODERS)]  # type: ignore[valid-type]
_DECODE = typer.Option(help="decoding mode: auto sizes speculation for the link; greedy output is the same in all")

# Spellings of an earlier release, still accepted with a notice: (command path, old) -> new option,
# or None for an option that is ignored now. Value conversions are done by the commands themselves.
DEPRECATED: dict[tuple[tuple[str, ...], str], str | None] = {
    **{((cmd,), "--reconnect-deadline"): "--reconnect-deadline-s" for cmd in ("generate", "chat", "client-api")},
    (("serve",), "--session-ttl"): "--session-ttl-s",
    (("serve",), "--idle-timeout"): "--idle-timeout-s",
    (("serve",), "--send-timeout"): "--send-timeout-s",
    (("serve",), "--wire-dtype"): None,
    (("demo",), "--rtt"): "--rtt-ms",
    (("netem",), "--rtt"): "--rtt-ms",
    (("netem",), "--jitter"): "--jitter-ms",
    (("netem",), "--bandwidth"): "--bandwidth-mbit",
    (("bench", "runtime"), "--rtt"): "--rtt-ms",
    (("bench", "sweep"), "--points"): "--links",
    (("bench", "sweep"), "--per-category"): "--prompts-per-category",
    (("bench", "sweep"), "--quiet-deadline"): "--quiet-deadline-min",
    (("bench", "speculation"), "--rtt"): "--rtt-ms",
    (("bench", "speculation"), "--modes"): "--decode",
    (("bench", "load"), "--rtt"): "--rtt-ms",
    (("bench", "load"), "--context"): "--max-context",
    (("privacy", "audit"), "--heads"): "--head",
    (("privacy", "audit"), "--tails"): "--tail",
}
_TAKES_VALUE_IGNORED = {"--wire-dtype"}
_ADVICE = {"--quiet-deadline-min": "--quiet-deadline-s (seconds)"}  # where the new name is not the advice


def upgrade_argv(argv: Sequence[str], warn: Callable[[str], None]) -> list[str]:
    """`argv` with deprecated option spellings replaced by the current ones, each with a notice."""
    path = tuple(a for a in argv[:2] if not a.startswith("-"))
    out: list[str] = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        name, eq, value = arg.partition("=")
        key = next((k for k in ((path[:n], name) for n in (2, 1)) if k in DEPRECATED), None)
        if key is None:
            out.append(arg)
            continue
        new = DEPRECATED[key]
        if new is None:
            warn(f"warning: {name} is deprecated and ignored (it will be removed in the next release)")
            skip = not eq and name in _TAKES_VALUE_IGNORED and i + 1 < len(argv)
            continue
        warn(f"warning: {name} is deprecated; use {_ADVICE.get(new, new)} (the old name goes in the next release)")
        out.append(f"{new}{eq}{value}" if eq else new)
    return out


def main() -> None:
    """The `splitllm` entry point: today's spellings of the arguments, then the commands."""
    app(upgrade_argv(sys.argv[1:], lambda line: print(line, file=sys.stderr)), prog_name="splitllm")


def _precision(dtype: str, quant: str, device: str):  # type: ignore[no-untyped-def]
    from splitllm.model.precision import Precision

    try:
        return Precision.parse(dtype, quant, device)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _setting(name: str):  # type: ignore[no-untyped-def]
    """A 'dtype-quant' name (float32-none, bfloat16-int8, ...) as a Precision."""
    from splitllm.model.precision import Precision

    try:
        return Precision.from_name(name)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _threads(n: int) -> None:
    from splitllm.threads import set_compute_threads

    set_compute_threads(n)


def _numbers(text: str, kind: type) -> tuple:
    """A comma-separated list of numbers, the form every option taking several values uses."""
    try:
        return tuple(kind(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise typer.BadParameter(f"not a comma-separated list of numbers: {text!r}") from None


def _need_extra(extra: str) -> None:
    """Stop with the install line when an optional part's dependencies are missing."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        typer.echo(f"error: this command needs the '{extra}' extra: pip install 'splitllm[{extra}]'", err=True)
        raise typer.Exit(2)


def _client(
    server: Annotated[Optional[str], typer.Option(help="ws(s)://host:port of a splitllm server; omit to run in-process")] = None,
    model: str = "default",
    head: int = 2,
    tail: int = 2,
    wire_dtype: str = "float16",
    dtype: Annotated[str, typer.Option(help="compute dtype of the client's layers: float32, bfloat16 or float16")] = "float32",
    quant: Annotated[str, typer.Option(help="weight-only quantization of the client's layers: none, int8 or int4")] = "none",
    device: Annotated[str, typer.Option(help="cpu, cuda or mps (only cpu is verified)")] = "cpu",
    lm_head_dtype: Annotated[Optional[str], typer.Option(help="compute dtype of embedding and LM head (default: --dtype)")] = None,
    lm_head_quant: Annotated[Optional[str], typer.Option(help="quantization of the LM head (default: --quant)")] = None,
    threads: int = 1,
    token_file: Annotated[Optional[str], typer.Option(help="file holding the bearer token (default: $SPLITLLM_TOKEN)")] = None,
    ca: Annotated[Optional[str], typer.Option(help="PEM CA bundle to verify a wss:// server (self-signed setups)")] = None,
    insecure: Annotated[bool, typer.Option(help="skip wss:// certificate checks (tests only)")] = False,
    client_cert: Annotated[Optional[str], typer.Option(help="PEM client certificate for mutual TLS")] = None,
    client_key: Annotated[Optional[str], typer.Option(help="PEM key of --client-cert")] = None,
    fallback: Annotated[Optional[list[str]], typer.Option(help="another server to fail over to (repeatable)")] = None,
    reconnect_deadline_s: Annotated[float, typer.Option(help="seconds to keep trying to reach a server")] = 60.0,
    draft_head: Annotated[Optional[str], typer.Option(help="draft head folder (`splitllm draft train`); default: the shipped one")] = None,
) -> Any:
    """The SplitClient that the model and connection options of every client command describe."""
    from splitllm.client.connection import ConnectionOptions, read_token
    from splitllm.client.session import SplitClient

    _threads(threads)
    options = ConnectionOptions(
        token=read_token(token_file), ca_file=ca, insecure=insecure, client_cert=client_cert, client_key=client_key,
        fallbacks=tuple(fallback or ()), deadline_s=reconnect_deadline_s,
    )
    precision = _precision(dtype, quant, device)
    head_precision = _precision(lm_head_dtype or dtype, lm_head_quant or quant, device)
    return SplitClient(
        model, server, head, tail, wire_dtype, dtype=precision, head_precision=head_precision, connection=options,
        draft_head=draft_head,
    )


def _sampling(
    sample: Annotated[bool, typer.Option("--sample/--greedy", help="sample instead of taking the argmax")] = False,
    temperature: float = 1.0,
    top_k: Annotated[int, typer.Option(help="keep the k likeliest tokens (0: all)")] = 0,
    top_p: Annotated[float, typer.Option(help="keep the likeliest tokens covering this probability")] = 1.0,
    repetition_penalty: float = 1.0,
    seed: Annotated[Optional[int], typer.Option(help="fixes the samples")] = None,
) -> Any:
    """The SamplingParams of the sampling options."""
    from splitllm.decoding.sampling import SamplingParams

    return SamplingParams(
        do_sample=sample, temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty, seed=seed
    )


def _with_options(**groups: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command every option of each group (a function like `_client`) and call it with what
    the group builds from them, under the group's name, so commands share options without copies."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        shared = {name: inspect.signature(build, eval_str=True).parameters for name, build in groups.items()}
        own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.name not in groups]
        params = own + [p for group in shared.values() for p in group.values()]

        @functools.wraps(command)
        def run(**kwargs: Any) -> Any:
            try:
                built = {name: build(**{k: kwargs.pop(k) for k in shared[name]}) for name, build in groups.items()}
            except (ValueError, OSError) as exc:
                typer.echo(f"error: {exc}", err=True)
                raise typer.Exit(2) from None
            return command(**kwargs, **built)

        run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run

    return decorate


@app.command()
def serve(
    model: Annotated[str, typer.Option(help="'default', 'gemma3', an HF folder or a .gguf file")] = "default",
    head: Annotated[int, typer.Option(help="layers the client runs first")] = 2,
    tail: Annotated[int, typer.Option(help="layers the client runs last")] = 2,
    host: str = "127.0.0.1",
    port: int = 8765,
    dtype: Annotated[str, typer.Option(help="compute dtype: float32 (exact), bfloat16 or float16")] = "float32",
    quant: Annotated[str, typer.Option(help="weight-only quantization: none, int8 or int4")] = "none",
    device: Annotated[str, typer.Option(help="cpu, cuda or mps (only cpu is verified)")] = "cpu",
    max_context: Annotated[int, typer.Option(help="longest session, in tokens")] = 4096,
    max_sessions: int = 64,
    session_ttl_s: Annotated[float, typer.Option(help="idle seconds before a session is dropped")] = 600.0,
    threads: Annotated[int, typer.Option(help="compute threads")] = 1,
    tls_cert: Annotated[Optional[str], typer.Option(help="PEM certificate chain: serve wss://")] = None,
    tls_key: Annotated[Optional[str], typer.Option(help="PEM private key of --tls-cert")] = None,
    client_ca: Annotated[Optional[str], typer.Option(help="PEM CA: require client certificates it signed (mutual TLS)")] = None,
    auth_token_file: Annotated[Optional[str], typer.Option(help="file of 'principal:token' lines; clients must present one")] = None,
    max_sessions_per_principal: Annotated[Optional[int], typer.Option(help="default: --max-sessions")] = None,
    max_kv_gib: Annotated[float, typer.Option(help="bound on the KV cache memory of all sessions, GiB")] = 8.0,
    max_nodes_per_step: Annotated[int, typer.Option(help="positions per step; clients split longer prompts")] = 256,
    max_frame_mib: Annotated[float, typer.Option(help="largest WebSocket message accepted, MiB")] = 64.0,
    idle_timeout_s: Annotated[float, typer.Option(help="seconds before a silent connection is closed")] = 600.0,
    send_timeout_s: Annotated[float, typer.Option(help="seconds a peer may take to read a reply")] = 30.0,
    max_connections: Annotated[int, typer.Option(help="open WebSockets; /health is never refused")] = 256,
    max_connections_per_principal: Annotated[
        Optional[int], typer.Option(help="default: a quarter of --max-connections with tokens, else all")
    ] = None,
    operator: Annotated[
        Optional[list[str]], typer.Option(help="principal whose /health and /metrics show the whole server (repeatable)")
    ] = None,
    handshake_timeout_s: Annotated[float, typer.Option(help="seconds a connection may take to send its request head")] = 10.0,
    max_header_kib: Annotated[int, typer.Option(help="largest request head (request line and headers), KiB")] = 16,
    max_batch_rows: Annotated[int, typer.Option(help="positions in one shared forward pass")] = 256,
    slice_rows: Annotated[
        int, typer.Option(help="a step longer than --slice-above (a prompt) runs as forwards of this many positions, others' steps in between")
    ] = 16,
    slice_above: Annotated[
        int, typer.Option(help="a step of at most this many positions (a speculative tree) always runs in one forward")
    ] = 64,
    max_batch_mib: Annotated[float, typer.Option(help="estimated activation and mask memory of one shared forward, MiB")] = 256.0,
    batch_window_ms: Annotated[
        float, typer.Option(help="steps of different sessions this close together share one forward; 0 disables")
    ] = 2.0,
    log_format: Annotated[str, typer.Option(help="text or json")] = "text",
    engine: Annotated[str, typer.Option(help="uvicorn (one process) or ray (Ray Serve replicas)")] = "uvicorn",
    replicas: Annotated[int, typer.Option(help="Ray Serve replicas (--engine ray)")] = 1,
    ray_address: Annotated[
        Optional[str], typer.Option(help="Ray cluster to deploy on, e.g. 'auto' (--engine ray; default: start one here)")
    ] = None,
) -> None:
    """Run the middle layers behind a WebSocket endpoint (never loads embedding or LM head)."""
    import uvicorn

    from splitllm.server.app import MiddleServer, ServerSettings
    from splitllm.server.auth import TokenTable
    from splitllm.server.logs import configure
    from splitllm.server.transport import TlsFiles, is_loopback, uvicorn_config

    if (tls_cert is None) != (tls_key is None) or (client_ca and not tls_cert):
        raise typer.BadParameter("--tls-cert and --tls-key go together, and --client-ca needs both")
    if engine not in ("uvicorn", "ray"):
        raise typer.BadParameter("--engine must be uvicorn or ray")
    if replicas < 1 or (replicas > 1 and engine != "ray"):
        raise typer.BadParameter("--replicas is at least 1, and more than 1 needs --engine ray")
    if engine == "ray" and client_ca:
        raise typer.BadParameter("--client-ca (mutual TLS) is not available with --engine ray; use --auth-token-file")
    configure(log_format)
    _threads(threads)
    precision = _precision(dtype, quant, device)
    try:
        settings = ServerSettings(
            head=head, tail=tail, dtype=precision.dtype, quant=precision.quant, device=precision.device,
            max_context=max_context, max_sessions=max_sessions,
            session_ttl_s=session_ttl_s, max_nodes_per_step=max_nodes_per_step, max_frame_bytes=int(max_frame_mib * (1 << 20)),
            max_sessions_per_principal=max_sessions_per_principal, max_kv_bytes=int(max_kv_gib * (1 << 30)),
            idle_timeout_s=idle_timeout_s, send_timeout_s=send_timeout_s, max_connections=max_connections,
            batch_window_ms=batch_window_ms,
            max_connections_per_principal=max_connections_per_principal,
            operators=tuple(operator or ()),
            max_batch_rows=max_batch_rows,
            slice_rows=slice_rows,
            slice_above=slice_above,
            max_batch_bytes=int(max_batch_mib * (1 << 20)),
            handshake_timeout_s=handshake_timeout_s,
            max_header_bytes=max_header_kib << 10,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    tls = TlsFiles(tls_cert, tls_key, client_ca) if tls_cert and tls_key else None
    scheme = "wss" if tls else "ws"
    if engine == "ray":
        _serve_on_ray(model, settings, auth_token_file, threads, log_format, replicas, host, port, ray_address, tls)
        return
    try:
        tokens = TokenTable.load(auth_token_file) if auth_token_file else None
        server = MiddleServer(model, settings, tokens)
    except (ValueError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"serving layers [{server.start}, {server.end}) on {scheme}://{host}:{port}/ws", err=True)
    if tokens is None:
        typer.echo("warning: no --auth-token-file: anyone who can reach this port can use it", err=True)
    elif tls is None and not is_loopback(host):
        typer.echo(f"warning: tokens will cross the network in clear text to {host}; use --tls-cert or a tunnel", err=True)
    uvicorn.Server(uvicorn_config(server, host, port, tls)).run()


def _serve_on_ray(
    model: str, settings: Any, tokens_file: str | None, threads: int, log_format: str, replicas: int,
    host: str, port: int, address: str | None, tls: Any,
) -> None:
    """`serve --engine ray`: deploy the replicas, then hold the deployment until interrupted or terminated."""
    import signal
    import time

    try:
        from splitllm.server import ray_deployment
    except ImportError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    spec = ray_deployment.ReplicaSpec(
        model=model, settings=settings, tokens_file=tokens_file, threads=threads, log_format=log_format
    )
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a terminated server still stops its Ray cluster
    try:
        ray_deployment.start(spec, replicas, host, port, address, tls)
        scheme = "wss" if tls else "ws"
        typer.echo(f"serving on {replicas} Ray Serve replica(s) at {scheme}://{host}:{port}/ws", err=True)
        if tokens_file is None:
            typer.echo("warning: no --auth-token-file: anyone who can reach this port can use it", err=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    except (ValueError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    finally:
        ray_deployment.shutdown()


@app.command()
@_with_options(client=_client, sampling=_sampling)
def generate(
    client: Any,
    sampling: Any,
    prompt: str,
    max_new_tokens: int = 128,
    decode: Annotated[DecodeMode, _DECODE] = DEFAULT_DECODE,
    stop: Annotated[Optional[list[str]], typer.Option(help="end the answer before this text (repeatable)")] = None,
    raw: Annotated[bool, typer.Option(help="skip the chat template")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object instead of streaming")] = False,
) -> None:
    """Generate text, streaming it, then a one-line summary of where the time went."""
    from splitllm.client.remote import ServerError

    try:
        gen = None
        printed = ""
        for gen, _ in client.stream(prompt, max_new_tokens, decode, not raw, sampling, stop or ()):
            if not as_json:
                sys.stdout.write(gen.text[len(printed) :])
                sys.stdout.flush()
                printed = gen.text
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
@_with_options(client=_client, sampling=_sampling)
def chat(
    client: Any,
    sampling: Any,
    decode: Annotated[DecodeMode, _DECODE] = DEFAULT_DECODE,
    max_new_tokens: Annotated[int, typer.Option(help="longest answer, in tokens")] = 256,
    system: Annotated[Optional[str], typer.Option(help="system prompt")] = None,
) -> None:
    """Chat in the terminal; every turn reuses the KV cache of the conversation so far."""
    import contextlib

    from splitllm.chat import run_chat

    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input())
    try:
        run_chat(client, decode, sampling, max_new_tokens, system)
    except ValueError as exc:  # a base model has no chat template
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


@app.command("client-api")
@_with_options(client=_client)
def client_api(
    client: Any,
    host: Annotated[str, typer.Option(help="address to listen on (keep it on the trusted device)")] = "127.0.0.1",
    port: int = 8000,
    decode: Annotated[DecodeMode, _DECODE] = DEFAULT_DECODE,
    served_model_name: Annotated[Optional[str], typer.Option(help="the model id clients see")] = None,
) -> None:
    """A local web chat at / and an OpenAI-compatible endpoint (/v1/chat/completions, /v1/completions,
    /v1/models) over the split; a request's 'decode' overrides --decode."""
    import uvicorn

    from splitllm.api.openai import create_app

    where = client.server or "in-process middle"
    typer.echo(f"web chat on http://{host}:{port}/ and OpenAI-compatible endpoint on http://{host}:{port}/v1 ({where})", err=True)
    uvicorn.run(create_app(client, served_model_name, decode), host=host, port=port, log_level="warning")


@app.command()
def demo(
    prompt: Annotated[Optional[str], typer.Argument(help="what to ask")] = None,
    rtt_ms: Annotated[float, typer.Option(help="emulated round-trip time, ms")] = 80.0,
    max_new_tokens: int = 96,
    decode: Annotated[DecodeMode, _DECODE] = DEFAULT_DECODE,
    setting: Annotated[
        Optional[str], typer.Option(help="dtype-quant of both sides, e.g. float32-none (exact); default: the fastest")
    ] = None,
) -> None:
    """Start a server, an emulated WAN link and a client on loopback; stream an answer, then compare
    its speed with sequential decoding of the same answer."""
    from splitllm.demo import DEMO_PROMPT, run_demo
    from splitllm.model.precision import FASTEST

    run_demo(prompt or DEMO_PROMPT, rtt_ms, max_new_tokens, decode, _setting(setting or FASTEST))


@app.command()
def netem(
    listen: Annotated[str, typer.Option(help="HOST:PORT to listen on (a bare PORT listens on --host)")],
    target: Annotated[str, typer.Option(help="HOST:PORT to forward to")],
    rtt_ms: Annotated[float, typer.Option(help="added round-trip time, ms")] = 80.0,
    jitter_ms: Annotated[float, typer.Option(help="jitter, ms")] = 0.0,
    bandwidth_mbit: Annotated[Optional[float], typer.Option(help="cap in Mbit/s each way")] = None,
    host: Annotated[Optional[str], typer.Option(hidden=True, help="deprecated: put the host in --listen")] = None,
) -> None:
    """A WAN emulator: a TCP proxy adding delay, jitter and a bandwidth cap."""
    from splitllm.netem import LinkProfile, run_netem

    if host is not None:
        typer.echo("warning: --host is deprecated; use --listen HOST:PORT (the old name goes in the next release)", err=True)
    listen_host, _, port = listen.rpartition(":")
    if not port.isdigit():
        raise typer.BadParameter(f"--listen takes HOST:PORT, not {listen!r}")
    listen_host = listen_host or host or "127.0.0.1"
    run_netem(listen_host, int(port), target, LinkProfile(rtt_ms=rtt_ms, jitter_ms=jitter_ms, bandwidth_mbit=bandwidth_mbit))


bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks over the real client, server and WAN proxy.")
app.add_typer(bench_app, name="bench")


# --- bench runtime: cost of the split runtime itself (server forward, loads, memory, decode steps) ---
@bench_app.command("runtime")
def bench_runtime(
    out: Annotated[str, typer.Option(help="folder for runtime.json and runtime.md")] = "results",
    head: int = 2,
    tail: int = 2,
    prompts_per_category: Annotated[int, typer.Option(help="workload prompts per category for decoding (1-8)")] = 1,
    dtype_prompts_per_category: Annotated[int, typer.Option(help="workload prompts per category for the wire dtype check")] = 2,
    max_new_tokens: int = 64,
    rtt_ms: Annotated[str, typer.Option(help="comma-separated emulated RTTs, ms")] = "0,80",
    wire_dtype: Annotated[str, typer.Option(help="wire dtype of the decoding runs")] = "float16",
    settings: Annotated[Optional[str], typer.Option(help="comma-separated dtype-quant settings (default: all measured)")] = None,
    fastest: Annotated[Optional[str], typer.Option(help="the setting decoded end to end next to float32-none")] = None,
    threads: Annotated[str, typer.Option(help="comma-separated thread counts of the server forward")] = "1,2",
) -> None:
    """Server forward per precision vs the memory-bandwidth floor, client step, loads, RSS, decoding, wire dtypes."""
    from pathlib import Path

    from splitllm.bench.runtime import FASTEST, SETTINGS, markdown, run_runtime

    if out.endswith(".json"):  # an earlier release took the report's path
        typer.echo("warning: --out takes a folder now; a .json path still works until the next release", err=True)
        path = Path(out)
    else:
        path = Path(out, "runtime.json")
    result = run_runtime(
        str(path), head, tail, prompts_per_category, max_new_tokens, _numbers(rtt_ms, float), wire_dtype,
        dtype_prompts_per_category, tuple(settings.split(",")) if settings else SETTINGS, fastest or FASTEST,
        _numbers(threads, int),
    )
    typer.echo(markdown(result))
    typer.echo(f"wrote {path}", err=True)
# --- end bench runtime ---


@bench_app.command("quality")
def bench_quality(
    out: Annotated[str, typer.Option(help="folder for quality.json and quality.md")] = "results",
    prompts_per_category: Annotated[int, typer.Option(help="workload prompts per category (8: the 32-prompt suite)")] = 8,
    max_new_tokens: int = 128,
    settings: Annotated[str, typer.Option(help="comma-separated dtype-quant settings to compare with float32-none")] = (
        "bfloat16-none,bfloat16-int8,bfloat16-int4"
    ),
    ppl_positions: Annotated[int, typer.Option(help="held-out text positions for perplexity")] = 3072,
) -> None:
    """Greedy agreement with float32 and perplexity on held-out text, per precision."""
    from splitllm.bench.quality import markdown, run_quality

    result = run_quality(tuple(settings.split(",")), prompts_per_category, max_new_tokens, ppl_positions, out)
    typer.echo(markdown(result))


@bench_app.command("streaming")
def bench_streaming(
    max_new_tokens: Annotated[int, typer.Option(help="length of the answer streamed")] = 2000,
    window: Annotated[int, typer.Option(help="steps compared at each end")] = 100,
    out: Annotated[str, typer.Option(help="folder for streaming.json and streaming.md")] = "results",
) -> None:
    """The client's per-step bookkeeping (stop strings, detokenizing) at the first and last tokens of a long answer."""
    from splitllm.bench.streaming import run_streaming

    typer.echo(run_streaming(out, max_new_tokens, window)["markdown"])


@bench_app.command("sweep")
def bench_sweep(
    out: Annotated[str, typer.Option(help="folder for steps.json, sweep.json, sweep.md and the plots")] = "results/sweep",
    links: Annotated[str, typer.Option(help="comma-separated links: RTT ms, or RTT@Mbit/s for a bandwidth cap")] = "0,20,40,80,120,200,80@20",
    prompts_per_category: Annotated[int, typer.Option(help="workload prompts per category")] = 1,
    max_new_tokens: int = 64,
    profile: Annotated[Optional[str], typer.Option(help="auto profile to use instead of calibrating one")] = None,
    merge: Annotated[bool, typer.Option(help="keep OUT/steps.json's runs at links not measured now")] = False,
    reanalyze: Annotated[bool, typer.Option(help="measure nothing: rebuild the report from OUT/steps.json")] = False,
    max_other_cores: Annotated[
        float, typer.Option(help="wait for, and redo generations until, others use fewer cores (0: never)")
    ] = 0.3,
    quiet_deadline_s: Annotated[
        float, typer.Option(help="seconds to wait for quiet moments; then what is left runs regardless")
    ] = 3600.0,
    quiet_deadline_min: Annotated[Optional[float], typer.Option(hidden=True, help="deprecated: --quiet-deadline-s")] = None,
    setting: Annotated[Optional[str], typer.Option(help="dtype-quant of both sides; default: the fastest")] = None,
) -> None:
    """Tokens per second against RTT for every mode: measured, predicted (cross-validated), plotted."""
    import shlex

    from splitllm.bench.sweep import Quiet
    from splitllm.bench.sweep_report import sweep
    from splitllm.model.precision import FASTEST

    _need_extra("bench")
    precision = _setting(setting or FASTEST)
    command = shlex.join(["splitllm", *sys.argv[1:]])
    quiet = Quiet(max_other_cores, quiet_deadline_s if quiet_deadline_min is None else quiet_deadline_min * 60)
    summary = sweep(out, links, prompts_per_category, max_new_tokens, profile, merge, reanalyze, command, quiet, precision)
    typer.echo(summary["markdown"])
    typer.echo(f"overall MAPE {100 * summary['mape']['overall']:.2f}%; plots: {', '.join(summary['plots'])}", err=True)


@bench_app.command("speculation")
@_with_options(sampling=_sampling)
def bench_speculation(
    sampling: Any,
    prompts_per_category: Annotated[int, typer.Option(help="workload prompts per category (1-8)")] = 3,
    max_new_tokens: int = 200,
    rtt_ms: Annotated[float, typer.Option(help="emulated round-trip time, ms")] = 80.0,
    decode: Annotated[
        str, typer.Option(help="comma-separated decoding modes (sequential always runs; auto-static: auto's static budget)")
    ] = "sequential,lookup,lookahead,draft,auto,auto-static",
    out: Annotated[str, typer.Option(help="folder for speculation.json and speculation.md")] = "results",
    wire_dtype: Annotated[str, typer.Option(help="float32 makes every mode's output sequential's, bit for bit")] = "float32",
    draft_head: Annotated[Optional[str], typer.Option(help="draft head folder (default: the shipped one)")] = None,
    setting: Annotated[Optional[str], typer.Option(help="dtype-quant of both sides; default: the fastest")] = None,
) -> None:
    """Tokens per round trip and speedup of each decoding mode through a server behind the WAN proxy."""
    from splitllm.bench.speculation import EXTRA_DECODERS, run_speculation
    from splitllm.model.precision import FASTEST

    modes = tuple(m.strip() for m in decode.split(",") if m.strip())
    unknown = [m for m in modes if m not in DECODERS and m not in EXTRA_DECODERS]
    if unknown:
        raise typer.BadParameter(f"unknown modes {', '.join(unknown)}; choose from {', '.join([*DECODERS, *EXTRA_DECODERS])}")
    result = run_speculation(
        prompts_per_category, max_new_tokens, rtt_ms, modes, out,
        progress=lambda line: typer.echo(line, err=True), sampling=sampling, wire_dtype=wire_dtype,
        draft_head=draft_head, precision=_setting(setting or FASTEST),
    )
    typer.echo(result["markdown"])


@bench_app.command("exactness")
def bench_exactness(
    prompts_per_category: Annotated[int, typer.Option(help="workload prompts per category (1-8)")] = 8,
    max_new_tokens: int = 128,
    out: Annotated[str, typer.Option(help="folder for exactness.json and exactness.md")] = "results",
    model: Annotated[str, typer.Option(help="'default', 'gemma3', an HF folder or a .gguf file")] = "default",
    setting: Annotated[str, typer.Option(help="dtype-quant of both sides (speculation against sequential in it)")] = (
        "float32-none"
    ),
) -> None:
    """Every speculative mode against sequential greedy on the real model; divergences with their logit gaps."""
    from splitllm.bench.exactness import NEAR_TIE, run_exactness

    report = run_exactness(prompts_per_category, max_new_tokens, out, model, _setting(setting))
    typer.echo(report.markdown())
    if not report.explained:
        typer.echo(f"error: a divergence at a top-2 logit gap >= {NEAR_TIE} is not a rounding effect", err=True)
        raise typer.Exit(1)


@bench_app.command("load")
def bench_load(
    clients: Annotated[str, typer.Option(help="comma-separated concurrent client counts (threads sharing one client model)")] = "1,4,16,64",
    batch_window_ms: Annotated[str, typer.Option(help="comma-separated batching windows, one server each; 0: off")] = "0,2",
    ray_replicas: Annotated[str, typer.Option(help="comma-separated Ray Serve replica counts, one deployment each (batching on); empty: none")] = "1,2",
    max_new_tokens: int = 32,
    rtt_ms: Annotated[float, typer.Option(help="emulated round-trip time, ms")] = 80.0,
    prompts: Annotated[int, typer.Option(help="distinct workload prompts, cycled over the clients")] = 8,
    max_context: Annotated[int, typer.Option(help="longest session, in tokens")] = 256,
    max_kv_gib: Annotated[float, typer.Option(help="the server's KV memory bound, GiB")] = 1.0,
    clients_compute: Annotated[
        str, typer.Option(help="device: clients replay solo runs, their compute a pause (own devices); real: all compute here")
    ] = "device",
    out: Annotated[str, typer.Option(help="folder for load.json, load.md and load.png")] = "results/load",
    prefill: Annotated[
        int, typer.Option(help="instead: the largest --clients decoders alone, then with one prompt of this many positions")
    ] = 0,
    max_nodes_per_step: Annotated[int, typer.Option(help="the server's positions per step (--prefill runs)")] = 256,
    max_batch_rows: Annotated[int, typer.Option(help="the server's positions per shared forward (--prefill runs)")] = 256,
    slice_rows: Annotated[int, typer.Option(help="the server's slice of a long step (--prefill runs)")] = 16,
) -> None:
    """Concurrent clients through the WAN proxy: correctness, step latency p50/p99, tokens/s, KV bound."""
    import shlex
    from pathlib import Path

    from splitllm.bench.load import LoadSettings, ServerKind, prefill_markdown, run_load, run_prefill

    _need_extra("bench")
    counts, windows, replicas = _numbers(clients, int), _numbers(batch_window_ms, float), _numbers(ray_replicas, int)
    if clients_compute not in ("device", "real"):
        raise typer.BadParameter("--clients-compute is device or real")
    if not counts or min(counts) < 1 or any(r < 1 for r in replicas) or any(w < 0 for w in windows):
        raise typer.BadParameter("client and replica counts are at least 1, windows at least 0")
    if replicas:
        try:
            import ray  # noqa: F401
        except ImportError:
            raise typer.BadParameter("--ray-replicas needs Ray Serve: pip install 'splitllm[ray]'") from None
    on = max(windows, default=2.0) or 2.0
    settings = LoadSettings(
        max_new_tokens=max_new_tokens, rtt_ms=rtt_ms, prompts=prompts, context=max_context, max_kv_gib=max_kv_gib,
        clients_compute="device" if prefill > 0 else clients_compute,
    )
    if prefill > 0:
        serve_args = [
            "--max-nodes-per-step", str(max_nodes_per_step), "--max-batch-rows", str(max_batch_rows),
            "--slice-rows", str(slice_rows),
        ]
        result = run_prefill(max(counts), prefill, settings, on, serve_args, out, shlex.join(["splitllm", *sys.argv[1:]]),
                             progress=lambda line: typer.echo(line, err=True))
        typer.echo(prefill_markdown(result))
        typer.echo(f"wrote {out}/prefill.json, prefill.md", err=True)
        rows = (result["alone"], result["with_prefill"])
        if not result["prefill_ok"] or any(r["errors"] or r["correct_clients"] != r["clients"] for r in rows):
            raise typer.Exit(1)
        return
    kinds = [ServerKind(w) for w in windows] + [ServerKind(on, r) for r in replicas]
    result = run_load(counts, kinds, settings, out, shlex.join(["splitllm", *sys.argv[1:]]),
                      progress=lambda line: typer.echo(line, err=True))
    typer.echo(Path(out, "load.md").read_text())
    typer.echo(f"wrote {out}/load.json, load.md, load.png", err=True)
    failed = [r for r in result["rows"] if r["errors"] or r["correct_clients"] != r["clients"]]
    if failed or not result["kv_within_bound"]:
        raise typer.Exit(1)


privacy_app = typer.Typer(no_args_is_help=True, help="What the server can learn from the hidden states.")
app.add_typer(privacy_app, name="privacy")


@privacy_app.command("audit")
def privacy_audit(
    model: Annotated[Optional[str], typer.Option(help="'default', 'gemma3', an HF folder or a .gguf file; --quick: a tiny random model")] = None,
    head: Annotated[Optional[str], typer.Option(help="comma-separated head depths K (layers before the state is sent) [default: 1,2,4,6,8,12; --quick: 1,2]")] = None,
    tail: Annotated[Optional[str], typer.Option(help="comma-separated tail depths M (layers after the state is returned) [default: 0,1,2,4,8; --quick: 0,1]")] = None,
    out: Annotated[str, typer.Option(help="folder for report.json, report.md and leakage.png")] = "results/privacy",
    quick: Annotated[bool, typer.Option(help="tiny random model and small settings, and fail unless every attack behaves (CI)")] = False,
    reduced: Annotated[bool, typer.Option(help="the default model at K 2, M 0, small sets and one setting per defense (for a busy 2-core machine)")] = False,
    train_positions: Annotated[Optional[int], typer.Option(help="training positions for the learned attacks [default: 12288]")] = None,
    test_positions: Annotated[Optional[int], typer.Option(help="held-out positions [default: 3072]")] = None,
    whitebox_windows: Annotated[Optional[int], typer.Option(help="whole test windows the white-box search inverts [default: 6]")] = None,
    long_windows: Annotated[Optional[int], typer.Option(help="whole long contexts the white-box search also inverts [default: 2]")] = None,
    whitebox_max_candidates: Annotated[int, typer.Option(help="white-box candidates per position on defended states at most (0: whole vocabulary)")] = 8192,
    update_docs: Annotated[bool, typer.Option(help="also publish the report to docs/privacy-audit and regenerate the README and docs tables")] = False,
    threads: Annotated[int, typer.Option(help="compute threads")] = 1,
) -> None:
    """Train and run token-recovery attacks at each split depth, measure defenses, write a report."""
    import logging as _logging
    import shutil
    from dataclasses import replace
    from pathlib import Path

    from splitllm.privacy import AuditConfig, run_audit
    from splitllm.privacy.report import PUBLISHED, markdown

    _need_extra("privacy")
    _logging.basicConfig(level=_logging.INFO, format="%(asctime)s %(message)s")
    settings: dict = dict(out_dir=Path(out), threads=threads)
    for name, value in (("heads", head), ("tails", tail)):
        if value:
            settings[name] = _numbers(value, int)
    for name, number in (
        ("train_positions", train_positions),
        ("test_positions", test_positions),
        ("whitebox_windows", whitebox_windows),
        ("long_windows", long_windows),
    ):
        if number is not None:
            settings[name] = number
    if quick:
        cfg = AuditConfig.quick(**settings, **({"model": model} if model else {}))
    elif reduced:
        cfg = AuditConfig.reduced(model=model, **settings)
        if whitebox_max_candidates != 8192:
            cfg = replace(cfg, whitebox_max_candidates=whitebox_max_candidates or None)
    else:
        cfg = AuditConfig(model=model, whitebox_max_candidates=whitebox_max_candidates or None, **settings)
    try:
        report = run_audit(cfg, quick=quick)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(markdown(report))
    typer.echo(f"wrote {out}/report.json, report.md, leakage.png", err=True)
    if update_docs:
        PUBLISHED.mkdir(parents=True, exist_ok=True)
        for name in ("report.json", "report.md", "leakage.png"):
            shutil.copy(Path(out) / name, PUBLISHED / name)
        privacy_docs(str(PUBLISHED / "report.json"))
    if report["checks"]:
        typer.echo("failed checks:\n- " + "\n- ".join(report["checks"]), err=True)
        raise typer.Exit(1)


@privacy_app.command("private-head")
def privacy_private_head(
    head: Annotated[str, typer.Option(help="comma-separated head depths K to train a private head at")] = "2,4,8",
    steps: Annotated[int, typer.Option(help="fine-tuning steps per head")] = 40,
    kl_budget: Annotated[float, typer.Option(help="KL budget from the public next-token distribution (nats/token)")] = 0.05,
    length: Annotated[int, typer.Option(help="training window (tokens)")] = 64,
    train_positions: Annotated[int, typer.Option(help="training positions for the attackers")] = 6144,
    test_positions: Annotated[int, typer.Option(help="held-out positions")] = 3072,
    out: Annotated[str, typer.Option(help="folder for private_head.json")] = "results/privacy",
    quick: Annotated[bool, typer.Option(help="tiny random model and small settings")] = False,
    threads: Annotated[int, typer.Option(help="compute threads")] = 1,
) -> None:
    """Fine-tune the client's first K layers with a secret seed and attack them without the secret."""
    import json as _json
    import logging as _logging
    from pathlib import Path

    from splitllm.privacy import AuditConfig
    from splitllm.privacy.audit import run_private_head

    _logging.basicConfig(level=_logging.INFO, format="%(asctime)s %(message)s")
    settings: dict = dict(
        out_dir=Path(out),
        threads=threads,
        private_heads=_numbers(head, int),
        private_steps=steps,
        private_kl_budget=kl_budget,
        private_length=length,
        long_windows=0,
    )
    if quick:
        cfg = AuditConfig.quick(**settings)
    else:
        sizes = dict(train_positions=train_positions, test_positions=test_positions, tails=(0,))
        cfg = AuditConfig(**sizes, whitebox_max_candidates=2048, defense_whitebox_windows=1, **settings)
    try:
        result = run_private_head(cfg)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(_json.dumps(result["private_head"], indent=1))


@privacy_app.command("docs")
def privacy_docs(
    report: Annotated[str, typer.Argument(help="the report.json to generate the tables from")] = "docs/privacy-audit/report.json",
) -> None:
    """Regenerate the privacy tables in README.md and docs/privacy.md from a report."""
    from pathlib import Path

    from splitllm.privacy.report import update_docs

    if not Path(report).is_file():
        typer.echo(f"error: no report at {report}", err=True)
        raise typer.Exit(2)
    changed = update_docs(Path(report), Path.cwd())
    typer.echo(f"updated {', '.join(map(str, changed))}" if changed else "docs already match the report")


draft_app = typer.Typer(no_args_is_help=True, help="The client's learned drafter: train a draft head for a model.")
app.add_typer(draft_app, name="draft")


@draft_app.command("train")
def draft_train(
    out: Annotated[str, typer.Option(help="folder for head.safetensors and head.json")],
    model: Annotated[str, typer.Option(help="'default', an HF folder or a .gguf file")] = "default",
    prompts: Annotated[int, typer.Option(help="self-distillation prompts the model answers")] = 480,
    max_new_tokens: Annotated[int, typer.Option(help="tokens per answer at most")] = 160,
    texts: Annotated[int, typer.Option(help="passages of standard-library prose and code")] = 96,
    vocab: Annotated[int, typer.Option(help="draft vocabulary: the most frequent target tokens")] = 8192,
    epochs: Annotated[int, typer.Option(help="passes over the training data")] = 6,
    passes: Annotated[int, typer.Option(help="unrolled draft steps per position while training")] = 3,
    seed: int = 0,
    work: Annotated[Optional[str], typer.Option(help="folder caching answers and features [default: under the cache]")] = None,
    threads: Annotated[int, typer.Option(help="compute threads")] = 1,
) -> None:
    """Train an EAGLE-style draft head on the model's own answers and features; write weights and metadata."""
    from splitllm.draft.build import DataSettings, build_head
    from splitllm.draft.train import TrainSettings

    _threads(threads)
    try:
        meta = build_head(
            model,
            out,
            DataSettings(prompts=prompts, max_new_tokens=max_new_tokens, texts=texts, seed=seed),
            TrainSettings(vocab=vocab, epochs=epochs, passes=passes, seed=seed),
            work=work,
            command=["splitllm", *sys.argv[1:]],
        )
    except (ValueError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps({k: meta[k] for k in ("validation", "seconds", "size_bytes")}, indent=1))
    typer.echo(f"wrote {out}/head.safetensors and head.json", err=True)


if __name__ == "__main__":
    main()
