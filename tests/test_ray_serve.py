"""Ray Serve scale-out on a local CPU-only Ray cluster started here: 2 replicas of the default model's
middle layers behind one HTTP address, 8 concurrent clients, and a replica killed mid-generation
whose clients must reconnect and lose nothing. Replicas are never attested: Ray runs code its driver
ships and any client of the cluster can call a replica's methods (docs/confidential.md)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import DEFAULT_SPLIT
from protocol_client import greedy

from splitllm.client.connection import ConnectionOptions
from splitllm.client.remote import RemoteMiddle
from splitllm.testing.launch import free_port
from splitllm.server.settings import ServerSettings

ray = pytest.importorskip("ray")
ray_deployment = pytest.importorskip("splitllm.server.ray_deployment")
serve = pytest.importorskip("ray.serve")

pytestmark = pytest.mark.slow
FIRST, LAST = DEFAULT_SPLIT
CLIENTS, NEW = 8, 24
MAX_NODES = 16  # the replicas' positions per step: the longer prompts go as several steps


def _replica_actor_names() -> list[str]:
    """Names of the application's live replica actors (in Ray's `serve` namespace)."""
    prefix = f"SERVE_REPLICA::{ray_deployment.APP_NAME}#{ray_deployment.DEPLOYMENT}#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))


def _wait_replicas(count: int, timeout_s: float = 120.0) -> None:
    """Block until the application runs `count` healthy replicas again."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = serve.status().applications.get(ray_deployment.APP_NAME)
        if status is not None and status.status == "RUNNING" and len(_replica_actor_names()) == count:
            return
        time.sleep(0.5)
    raise TimeoutError(f"the application did not get back to {count} running replicas in {timeout_s:.0f} s")


@pytest.fixture(scope="module")
def ray_url(default_files):  # type: ignore[no-untyped-def]
    """ws:// address of a 2-replica deployment (each replica: one compute thread, no CPU reservation)."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=80 << 20)
    port = free_port()
    settings = ServerSettings(first=FIRST, last=LAST, max_sessions=16, max_nodes_per_step=MAX_NODES)
    spec = ray_deployment.ReplicaSpec(model=str(default_files.path), settings=settings)
    try:
        ray_deployment.start(spec, replicas=2, host="127.0.0.1", port=port, cpus_per_replica=0)
        yield f"ws://127.0.0.1:{port}"
    finally:
        ray_deployment.shutdown()


@pytest.fixture(scope="module")
def prompts(random_ids) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [random_ids(6 + 3 * i, seed=100 + i, vocab=49152) for i in range(CLIENTS)]


@pytest.fixture(scope="module")
def expected(default_files, server, load_client_model, split_greedy,  # type: ignore[no-untyped-def]
             prompts) -> list[list[int]]:
    """Each prompt's greedy ids through a plain one-process server, one client at a time."""
    url = server(str(default_files.path), FIRST, LAST).url
    client_model = load_client_model(str(default_files.path), FIRST, LAST)
    return [split_greedy(client_model, url, p, NEW) for p in prompts]


def _middle(url: str, files, prompt: list[int]) -> RemoteMiddle:  # type: ignore[no-untyped-def]
    layers = (FIRST, files.config.num_layers - LAST)
    options = ConnectionOptions(deadline_s=120)
    return RemoteMiddle(url, files.fingerprint, layers, "float32", len(prompt) + NEW, options)


def _run_clients(  # type: ignore[no-untyped-def]
    url, files, client_model, prompts, after_token=None
) -> tuple[list[list[int]], list[RemoteMiddle]]:
    middles = [_middle(url, files, p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(greedy, client_model, m, p, NEW, after_token) for m, p in zip(middles, prompts)]
        return [f.result(timeout=600) for f in futures], middles


def test_two_replicas_serve_eight_concurrent_clients(  # type: ignore[no-untyped-def]
    ray_url, default_files, load_client_model, prompts, expected
) -> None:
    assert len(_replica_actor_names()) == 2
    got, middles = _run_clients(ray_url, default_files, load_client_model(str(default_files.path), FIRST, LAST),
                                prompts)
    assert got == expected
    assert sum(m.reconnects for m in middles) == 0


def test_a_replica_killed_mid_generation_loses_no_output(  # type: ignore[no-untyped-def]
    ray_url, default_files, load_client_model, prompts, expected
) -> None:
    victim = _replica_actor_names()[0]
    killed = threading.Event()
    lock = threading.Lock()

    def kill_once(count: int) -> None:
        """The first client to reach token 8 kills a replica; the others keep generating meanwhile."""
        if count == 8:
            with lock:
                if not killed.is_set():
                    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)  # as a crash would
                    killed.set()

    got, middles = _run_clients(ray_url, default_files, load_client_model(str(default_files.path), FIRST, LAST),
                                prompts, kill_once)
    assert killed.is_set()
    assert got == expected
    # Connections spread over both replicas, so the victim held some clients' sessions: they came back.
    assert sum(m.reconnects for m in middles) >= 1
    _wait_replicas(2)
    assert victim not in _replica_actor_names()


def test_a_prompt_three_times_max_nodes_on_ray(  # type: ignore[no-untyped-def]
    ray_url, default_files, server, load_client_model, split_greedy, random_ids
) -> None:
    prompt = random_ids(3 * MAX_NODES + 5, seed=7, vocab=49152)
    client_model = load_client_model(str(default_files.path), FIRST, LAST)
    want = split_greedy(client_model, server(str(default_files.path), FIRST, LAST).url, prompt, 8)  # one step, unsplit
    assert greedy(client_model, _middle(ray_url, default_files, prompt), prompt, 8) == want[:8]


def test_every_limit_is_settable_and_public_addresses_need_tokens(  # type: ignore[no-untyped-def]
    default_files
) -> None:
    settings = ray_deployment.settings_from_args(
        {"max_kv_bytes": "1048576", "max_connections_per_principal": 3, "operators": "ops,admin",
         "max_sessions_per_principal": "none", "handshake_timeout_s": "2.5", "max_batch_rows": 64}
    )
    assert (settings.max_kv_bytes, settings.max_connections_per_principal, settings.operators) == (1 << 20, 3,
                                                                                                   ("ops", "admin"))
    assert (settings.max_sessions_per_principal, settings.handshake_timeout_s, settings.max_batch_rows) == (None, 2.5,
                                                                                                            64)
    spec = ray_deployment.ReplicaSpec(model=str(default_files.path), settings=ServerSettings(first=FIRST, last=LAST))
    with pytest.raises(ValueError, match="needs a token file"):
        ray_deployment.start(spec, replicas=1, host="0.0.0.0", port=free_port())


def test_replicas_refuse_attestation(default_files, vendor) -> None:  # type: ignore[no-untyped-def]
    """Refused where the application is built, so no path (the command, `start`, a config file) deploys one."""
    settings = ServerSettings(first=FIRST, last=LAST, attestation="simulated", attestation_sim=str(vendor))
    spec = ray_deployment.ReplicaSpec(model=str(default_files.path), settings=settings)
    with pytest.raises(ValueError, match="cannot be attested: Ray runs code its driver ships"):
        ray_deployment.application(spec, 1)


def test_the_documented_serve_run_config_builds(default_files) -> None:  # type: ignore[no-untyped-def]
    import yaml

    config = yaml.safe_load((Path(__file__).parents[1] / "deploy" / "ray-serve.yaml").read_text())
    (app,) = config["applications"]
    assert app["name"] == ray_deployment.APP_NAME
    assert config["http_options"]["host"] == "127.0.0.1"  # loopback unless told otherwise
    module, _, builder = app["import_path"].partition(":")
    assert module == ray_deployment.__name__ and builder == "app_builder"
    ray_deployment.app_builder({**app["args"], "model": str(default_files.path)})
    with pytest.raises(ValueError, match="unknown arguments"):
        ray_deployment.app_builder({"replica": "2"})
    with pytest.raises(ValueError, match="at least one replica"):
        ray_deployment.app_builder({"model": str(default_files.path), "replicas": "0"})


def test_steps_are_capped_to_what_rays_proxy_passes() -> None:
    settings = ray_deployment.fit_to_proxy(ServerSettings(max_nodes_per_step=8192), hidden_size=576)
    assert settings.max_nodes_per_step == 7253 and settings.max_frame_bytes == 16 << 20
    assert ray_deployment.fit_to_proxy(ServerSettings(max_nodes_per_step=4096), 4096).max_nodes_per_step == 1020
    assert ray_deployment.fit_to_proxy(ServerSettings(max_nodes_per_step=64), 4096).max_nodes_per_step == 64
