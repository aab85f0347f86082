"""`splitllm serve`: the middle layers behind a WebSocket endpoint, in one process or as Ray Serve replicas."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Optional

import typer

from splitllm.commands.options import Head, Model, Port, Tail, Threads, fail, precision, reported, set_threads, with_options


def limits(
    max_context: Annotated[int, typer.Option(help="longest session, in tokens")] = 4096,
    max_sessions: int = 64,
    session_ttl_s: Annotated[float, typer.Option(help="idle seconds before a session is dropped")] = 600.0,
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
    handshake_timeout_s: Annotated[float, typer.Option(help="seconds a connection may take to send its request head")] = 10.0,
    max_header_kib: Annotated[int, typer.Option(help="largest request head (request line and headers), KiB")] = 16,
) -> dict[str, Any]:
    """What one peer may take of the server: the `ServerSettings` fields of the limit options."""
    return dict(
        max_context=max_context, max_sessions=max_sessions, session_ttl_s=session_ttl_s,
        max_sessions_per_principal=max_sessions_per_principal, max_kv_bytes=int(max_kv_gib * (1 << 30)),
        max_nodes_per_step=max_nodes_per_step, max_frame_bytes=int(max_frame_mib * (1 << 20)),
        idle_timeout_s=idle_timeout_s, send_timeout_s=send_timeout_s, max_connections=max_connections,
        max_connections_per_principal=max_connections_per_principal, handshake_timeout_s=handshake_timeout_s,
        max_header_bytes=max_header_kib << 10,
    )


def batching(
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
) -> dict[str, Any]:
    """How steps of different sessions share forwards: the `ServerSettings` fields of the batching options."""
    return dict(
        max_batch_rows=max_batch_rows, slice_rows=slice_rows, slice_above=slice_above,
        max_batch_bytes=int(max_batch_mib * (1 << 20)), batch_window_ms=batch_window_ms,
    )


@dataclass(frozen=True)
class Access:
    """Who may connect and how: TLS files, the token table's file and the operators."""

    tls: Any  # TlsFiles or None
    tokens_file: str | None
    operators: tuple[str, ...]


def access(
    tls_cert: Annotated[Optional[str], typer.Option(help="PEM certificate chain: serve wss://")] = None,
    tls_key: Annotated[Optional[str], typer.Option(help="PEM private key of --tls-cert")] = None,
    client_ca: Annotated[Optional[str], typer.Option(help="PEM CA: require client certificates it signed (mutual TLS)")] = None,
    auth_token_file: Annotated[Optional[str], typer.Option(help="file of 'principal:token' lines; clients must present one")] = None,
    operator: Annotated[
        Optional[list[str]], typer.Option(help="principal whose /health and /metrics show the whole server (repeatable)")
    ] = None,
) -> Access:
    from splitllm.server.transport import TlsFiles

    if (tls_cert is None) != (tls_key is None) or (client_ca and not tls_cert):
        raise typer.BadParameter("--tls-cert and --tls-key go together, and --client-ca needs both")
    tls = TlsFiles(tls_cert, tls_key, client_ca) if tls_cert and tls_key else None
    return Access(tls, auth_token_file, tuple(operator or ()))


def serve(
    model: Model = "default",
    head: Head = 2,
    tail: Tail = 2,
    host: str = "127.0.0.1",
    port: Port = 8765,
    threads: Threads = None,
    attestation: Annotated[str, typer.Option(help="evidence offered to clients: none, sev-snp or tdx (from this confidential VM's firmware), or simulated (docs/confidential.md)")] = "none",
    attestation_sim: Annotated[Optional[str], typer.Option(help="folder of `splitllm attest sim-init` (--attestation simulated)")] = None,
    log_format: Annotated[str, typer.Option(help="text or json")] = "text",
    engine: Annotated[str, typer.Option(help="uvicorn (one process) or ray (Ray Serve replicas)")] = "uvicorn",
    replicas: Annotated[int, typer.Option(help="Ray Serve replicas (--engine ray)")] = 1,
    ray_address: Annotated[
        Optional[str], typer.Option(help="Ray cluster to deploy on, e.g. 'auto' (--engine ray; default: start one here)")
    ] = None,
    *,
    precision: Any,
    limits: dict[str, Any],
    batching: dict[str, Any],
    access: Access,
) -> None:
    """Run the middle layers behind a WebSocket endpoint (never loads embedding or LM head); without
    --attestation its operator can read the hidden states clients send."""
    import uvicorn

    from splitllm.server.app import MiddleServer
    from splitllm.server.auth import TokenTable
    from splitllm.server.logs import configure
    from splitllm.server.settings import ServerSettings
    from splitllm.server.transport import is_loopback, uvicorn_config

    if engine not in ("uvicorn", "ray"):
        raise typer.BadParameter("--engine must be uvicorn or ray")
    if replicas < 1 or (replicas > 1 and engine != "ray"):
        raise typer.BadParameter("--replicas is at least 1, and more than 1 needs --engine ray")
    if engine == "ray" and access.tls is not None and access.tls.client_ca:
        raise typer.BadParameter("--client-ca (mutual TLS) is not available with --engine ray; use --auth-token-file")
    configure(log_format)
    threads = set_threads(threads)
    try:
        settings = ServerSettings(
            head=head, tail=tail, dtype=precision.dtype, quant=precision.quant, device=precision.device,
            operators=access.operators, attestation=attestation, attestation_sim=attestation_sim, **limits, **batching,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if engine == "ray":
        from splitllm.attestation.evidence import load_attester

        with reported(ValueError, OSError):  # here, before any replica starts
            load_attester(settings.attestation, settings.attestation_sim)
        _serve_on_ray(model, settings, access, threads, log_format, replicas, host, port, ray_address)
        return
    with reported(ValueError, OSError):
        tokens = TokenTable.load(access.tokens_file) if access.tokens_file else None
        server = MiddleServer(model, settings, tokens)
    scheme = "wss" if access.tls else "ws"
    typer.echo(f"serving layers [{server.start}, {server.end}) on {scheme}://{host}:{port}/ws", err=True)
    _say_confidentiality(settings)
    if tokens is None:
        typer.echo("warning: no --auth-token-file: anyone who can reach this port can use it", err=True)
    elif access.tls is None and not is_loopback(host):
        typer.echo(f"warning: tokens will cross the network in clear text to {host}; use --tls-cert or a tunnel", err=True)
    uvicorn.Server(uvicorn_config(server, host, port, access.tls)).run()


def _say_confidentiality(settings: Any) -> None:
    """Said once at start: who can read the hidden states this server receives."""
    if settings.attestation == "none":
        typer.echo("warning: no --attestation: this server's operator can read the hidden states clients send, "
                   "which are as good as their text (docs/privacy.md)", err=True)
    elif settings.attestation == "simulated":
        typer.echo("warning: --attestation simulated: the evidence is signed by a simulated vendor and protects "
                   "nothing (tests and development only)", err=True)
    else:
        typer.echo(f"confidential: {settings.attestation} evidence for every client; sessions are sealed", err=True)


def _serve_on_ray(
    model: str, settings: Any, access: Access, threads: int, log_format: str, replicas: int,
    host: str, port: int, address: str | None,
) -> None:
    """`serve --engine ray`: deploy the replicas, then hold the deployment until interrupted or terminated."""
    import signal
    import time

    try:
        from splitllm.server import ray_deployment
    except ImportError as exc:
        fail(exc)
    spec = ray_deployment.ReplicaSpec(
        model=model, settings=settings, tokens_file=access.tokens_file, threads=threads, log_format=log_format
    )
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a terminated server still stops its Ray cluster
    try:
        with reported(ValueError, OSError):
            ray_deployment.start(spec, replicas, host, port, address, access.tls)
            scheme = "wss" if access.tls else "ws"
            typer.echo(f"serving on {replicas} Ray Serve replica(s) at {scheme}://{host}:{port}/ws", err=True)
            if access.tokens_file is None:
                typer.echo("warning: no --auth-token-file: anyone who can reach this port can use it", err=True)
            _say_confidentiality(settings)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        ray_deployment.shutdown()


def register(app: typer.Typer) -> None:
    app.command("serve")(with_options(precision=precision, limits=limits, batching=batching, access=access)(serve))
