"""`splitllm serve`: the middle layers behind a WebSocket endpoint, in one process or as Ray Serve replicas."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import typer

from splitllm.commands.wiring import AskedPrecision, command, fail, reported, set_threads
from splitllm.options import SERVE, Split
from splitllm.server.setting_fields import fields_of


@dataclass(frozen=True)
class Access:
    """Who may connect and how: TLS files, the token table's file and the operators."""

    tls: Any  # TlsFiles or None
    tokens_file: str | None
    operators: tuple[str, ...]


def access(
    tls_cert: str | None, tls_key: str | None, client_ca: str | None, auth_token_file: str | None,
    operator: list[str] | None,
) -> Access:
    from splitllm.server.transport import TlsFiles

    if (tls_cert is None) != (tls_key is None) or (client_ca and not tls_cert):
        raise typer.BadParameter("--tls-cert and --tls-key go together, and --client-ca needs both")
    tls = TlsFiles(tls_cert, tls_key, client_ca) if tls_cert and tls_key else None
    return Access(tls, auth_token_file, tuple(operator or ()))


@dataclass(frozen=True)
class Deployment:
    """How the server runs: in this process under uvicorn, or as Ray Serve replicas."""

    engine: str
    replicas: int
    ray_address: str | None

    def __post_init__(self) -> None:
        if self.engine not in ("uvicorn", "ray"):
            raise typer.BadParameter("--engine must be uvicorn or ray")
        if self.replicas < 1 or (self.replicas > 1 and self.engine != "ray"):
            raise typer.BadParameter("--replicas is at least 1, and more than 1 needs --engine ray")


def serve(
    split: Split, precision: AskedPrecision, server: dict[str, Any], access: Access, deployment: Deployment,
    host: str, port: int, threads: int | None, log_format: str,
) -> None:
    """Run the middle layers behind a WebSocket endpoint (never loads embedding or LM head); without
    --attestation its operator can read the hidden states clients send."""
    import uvicorn

    from splitllm.server.app import MiddleServer
    from splitllm.server.auth import TokenTable
    from splitllm.server.logs import configure
    from splitllm.server.settings import ServerSettings
    from splitllm.server.transport import is_loopback, uvicorn_config

    if deployment.engine == "ray" and server["attestation"] != "none":
        raise typer.BadParameter(
            "--attestation needs --engine uvicorn: Ray runs code its driver ships (pickled deployments, runtime "
            "environments) and any client of the cluster can call a replica's methods, so whoever runs the cluster "
            "could run code inside an attested replica that its measurement does not cover (docs/confidential.md)"
        )
    chosen = precision.resolve("precision")
    if deployment.engine == "ray" and access.tls is not None and access.tls.client_ca:
        raise typer.BadParameter("--client-ca (mutual TLS) is not available with --engine ray; use --auth-token-file")
    configure(log_format)
    threads = set_threads(threads)
    try:
        settings = ServerSettings(
            first=split.first, last=split.last, dtype=chosen.dtype, quant=chosen.quant, device=chosen.device,
            operators=access.operators, **server,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if deployment.engine == "ray":
        _serve_on_ray(split.model, settings, access, threads, log_format, deployment, host, port)
        return
    with reported(ValueError, OSError):
        tokens = TokenTable.load(access.tokens_file) if access.tokens_file else None
        middle = MiddleServer(split.model, settings, tokens)
    scheme = "wss" if access.tls else "ws"
    typer.echo(f"serving layers [{middle.start}, {middle.end}) on {scheme}://{host}:{port}/ws", err=True)
    _say_confidentiality(settings)
    if tokens is None:
        typer.echo("warning: no --auth-token-file: anyone who can reach this port can use it", err=True)
    elif access.tls is None and not is_loopback(host):
        typer.echo(f"warning: tokens will cross the network in clear text to {host}; use --tls-cert or a tunnel",
                   err=True)
    uvicorn.Server(uvicorn_config(middle, host, port, access.tls)).run()


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
    model: str, settings: Any, access: Access, threads: int, log_format: str, deployment: Deployment, host: str,
    port: int,
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
            ray_deployment.start(spec, deployment.replicas, host, port, deployment.ray_address, access.tls)
            scheme = "wss" if access.tls else "ws"
            typer.echo(f"serving on {deployment.replicas} Ray Serve replica(s) at {scheme}://{host}:{port}/ws",
                       err=True)
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
    command(app, SERVE, split=Split, precision=AskedPrecision, server=fields_of, access=access,
            deployment=Deployment)(serve)
