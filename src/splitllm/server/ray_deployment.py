"""Ray Serve hosting: the server's ASGI app on R replicas behind one HTTP address.

Ray Serve keeps a WebSocket on the replica that accepted it for the connection's whole life, which
is the affinity a session's KV cache needs, and routes each new connection to a replica with few
open ones. A replica that dies takes its sessions with it; their clients reconnect to the same
address and replay their committed hidden states into a new session on a live replica (the normal
reconnect path), so no output is lost. Ray restarts the dead replica meanwhile.

Replicas are never attested (`application` refuses an --attestation): Ray runs code its driver ships
(pickled deployments, runtime environments) and any client of the cluster can call a replica actor's
methods, so a replica would run code its measurement does not cover.

Defaults are safe: the proxy listens on loopback unless told otherwise, and off loopback it needs
a token file (TLS passes through to Ray's proxy). Every `serve` limit is settable from a config file
(`app_builder`). Ray's own cluster traffic should run with `RAY_AUTH_MODE=token` (Ray >= 2.52, the
version the `ray` extra pins), so nobody on the network can submit work to the cluster itself.

`ray` is an optional extra: `pip install 'splitllm[ray]'`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, cast, get_type_hints


from splitllm.weights.sources import ModelFiles
from splitllm.server.app import MiddleServer, create_app
from splitllm.server.auth import TokenTable
from splitllm.server.logs import configure
from splitllm.server.settings import ServerSettings
from splitllm.server.transport import TlsFiles, is_loopback
from splitllm.threads import set_compute_threads

try:
    import ray
    from ray import serve
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the Ray engine needs Ray Serve: pip install 'splitllm[ray]'") from exc

APP_NAME = "splitllm"
DEPLOYMENT = "MiddleReplica"
PROXY_MAX_FRAME = 16 << 20  # Ray's HTTP proxy (uvicorn, default ws_max_size) drops bigger WebSocket messages
_FRAME_SLACK = 1 << 16  # room for a step's header, visibility and ids next to its hidden states


@dataclass(frozen=True, kw_only=True)
class ReplicaSpec:
    """What every replica runs: the model split, its limits and its compute threads."""

    model: str | None
    settings: ServerSettings
    tokens_file: str | None = None
    threads: int = 1
    log_format: str = "text"


@serve.ingress()
class MiddleReplica:
    """One replica: a MiddleServer (layers, sessions, batcher) and the ASGI app in front of it."""

    def __init__(self, spec: ReplicaSpec) -> None:
        configure(spec.log_format)
        set_compute_threads(spec.threads)
        tokens = TokenTable.load(spec.tokens_file) if spec.tokens_file else None
        settings = fit_to_proxy(spec.settings, ModelFiles(spec.model).config.hidden_size)
        self.server = MiddleServer(spec.model, settings, tokens)

    def __serve_build_asgi_app__(self) -> Any:
        return create_app(self.server)


def fit_to_proxy(settings: ServerSettings, hidden_size: int) -> ServerSettings:
    """Cap positions per step so a step frame (float32 hidden states at worst) passes Ray's proxy.

    Clients split a longer prefill into steps of the `max_nodes` the server announces, so the cap
    costs nothing but a few more frames for very long prompts on very wide models.
    """
    fits = max((PROXY_MAX_FRAME - _FRAME_SLACK) // (4 * hidden_size), 1)
    return dataclasses.replace(
        settings,
        max_nodes_per_step=min(settings.max_nodes_per_step, fits),
        max_frame_bytes=min(settings.max_frame_bytes, PROXY_MAX_FRAME),
    )


def application(spec: ReplicaSpec, replicas: int, cpus_per_replica: float | None = None) -> Any:
    """The Serve application: `replicas` copies of MiddleReplica, each taking `threads` CPUs by default.

    The model is only read on the replicas (each caps its steps to the proxy's frame size for its
    model's width), so the machine that deploys needs no copy of it.
    """
    if replicas < 1:
        raise ValueError("a deployment needs at least one replica")
    if spec.settings.attestation != "none":
        raise ValueError(
            "Ray Serve replicas cannot be attested: Ray runs code its driver ships and any client of the cluster can "
            "call a replica's methods, which no measurement covers (docs/confidential.md); serve with uvicorn"
        )
    # Given the class, serve.deployment returns the Deployment (Ray types only its decorator form).
    deployment = cast("serve.Deployment", serve.deployment(
        MiddleReplica,
        name=DEPLOYMENT,
        num_replicas=replicas,
        # Each connection is one ongoing request for its lifetime: allow as many as a replica accepts.
        max_ongoing_requests=spec.settings.max_connections,
        ray_actor_options={"num_cpus": spec.threads if cpus_per_replica is None else cpus_per_replica},
        health_check_period_s=5,
        graceful_shutdown_timeout_s=5,
    ))
    return deployment.bind(spec)


_SPEC_ARGS = {"model", "replicas", "threads", "auth_token_file", "log_format"}
# Settings a config file cannot set as plain values (the compute dtype travels as its name).
_SETTINGS_ARGS = {f.name for f in dataclasses.fields(ServerSettings)} - {"dtype"}


def settings_from_args(args: dict[str, Any]) -> ServerSettings:
    """ServerSettings from a config file's `args` (strings or YAML scalars), each field by its own type."""
    hints = get_type_hints(ServerSettings)
    values: dict[str, Any] = {}
    for name in _SETTINGS_ARGS & set(args):
        raw, hint = args[name], str(hints[name])
        if name == "operators":
            values[name] = tuple(raw.split(",") if isinstance(raw, str) else raw)
        elif "str" in hint and raw is not None:
            values[name] = str(raw)
        elif raw is None or (isinstance(raw, str) and raw.lower() == "none"):
            values[name] = None
        else:
            values[name] = float(raw) if "float" in hint else int(raw)
    return ServerSettings(**values)


def app_builder(args: dict[str, Any]) -> Any:
    """For `serve run splitllm.server.ray_deployment:app_builder model=default replicas=2 first=2 last=2`.

    Every ServerSettings field (max_sessions, max_kv_bytes, max_connections, max_connections_per_principal,
    operators, max_batch_rows, ...) is an argument of the same name.
    """
    unknown = set(args) - _SPEC_ARGS - _SETTINGS_ARGS
    if unknown:
        raise ValueError(f"unknown arguments {sorted(unknown)}; known: {sorted(_SPEC_ARGS | _SETTINGS_ARGS)}")
    spec = ReplicaSpec(
        model=args.get("model", "default"),
        settings=settings_from_args(args),
        tokens_file=args.get("auth_token_file"),
        threads=int(args.get("threads", 1)),
        log_format=args.get("log_format", "text"),
    )
    return application(spec, int(args.get("replicas", 1)))


def start(
    spec: ReplicaSpec,
    replicas: int,
    host: str,
    port: int,
    address: str | None = None,
    tls: TlsFiles | None = None,
    cpus_per_replica: float | None = None,
) -> None:
    """Deploy on a Ray cluster (`address`; None starts a local one) and wait until every replica runs.

    A local cluster gets enough logical CPUs for every replica (oversubscribing a small machine
    rather than waiting forever for CPUs it does not have); a real cluster's resources are its own.
    Off loopback the replicas must hold a token file: an open port would serve anyone.
    """
    if not is_loopback(host) and spec.tokens_file is None:
        raise ValueError(f"listening on {host} (not loopback) needs a token file; or listen on 127.0.0.1")
    if not ray.is_initialized():
        cpus = None
        if address is None:
            cpus = max(os.cpu_count() or 1,
                       math.ceil(replicas * (spec.threads if cpus_per_replica is None else cpus_per_replica)))
        ray.init(address=address, num_cpus=cpus, include_dashboard=False)
    http: dict[str, Any] = {"host": host, "port": port}
    if tls is not None:
        if tls.client_ca:  # Ray's proxy would load the CA but never ask for client certificates
            raise ValueError("mutual TLS is not available behind Ray Serve's proxy; use bearer tokens")
        http |= {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
    serve.start(http_options=http)
    serve.run(application(spec, replicas, cpus_per_replica), name=APP_NAME, route_prefix="/")


def shutdown() -> None:
    serve.shutdown()
    ray.shutdown()
