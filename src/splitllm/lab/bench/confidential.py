"""`splitllm bench confidential`: what attestation and sealed frames cost, against the same split in the clear.

Two server subprocesses on the server's cores, one plain and one attested (the simulated vendor: the
same report format, signature and verification as SEV-SNP, without a confidential VM's own cost),
each behind its own WAN proxy. For every prompt the client decodes through both, alternating which
goes first, so a disturbance of the shared machine hits them alike and the ratio is measured in one
run. Also: the handshake (connect and open, plain against attest and open) and the sealing of one
step's frames in both directions, at the sizes the runs sent. `auto` sizes its trees from the timings
it measures, so its plain and sealed runs speculate differently (same output, other tokens per step);
`sequential` sends the same steps both ways and shows sealing's own cost.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence

from splitllm.attestation.policy import AttestationPolicy
from splitllm.attestation.sealing import SealedChannel
from splitllm.attestation.simulation import sim_init
from splitllm.client.connection import ConnectionOptions
from splitllm.client.remote import RemoteMiddle
from splitllm.client.client import Generation, SplitClient
from splitllm.lab.data.workload import workload
from splitllm.testing.launch import ServerProcess, on_cores, sides
from splitllm.testing.netem import LinkProfile, ProxyThread
from splitllm.model.precision import fastest
from splitllm.stats import SpeculationMetrics
from splitllm.threads import compute_threads_pinned, set_compute_threads

KINDS = ("plain", "sealed")
HANDSHAKES = 10


def _decode_totals(gens: Sequence[Generation]) -> dict:
    steps = [s for g in gens for s in g.steps[1:]]
    metrics = SpeculationMetrics.of(steps)
    times = [s.timing for s in steps]
    ms = sum(t.total_ms for t in times)
    return {
        "tokens": metrics.tokens,
        "steps": metrics.steps,
        "tokens_per_second": metrics.tokens / ms * 1000 if ms else 0.0,
        "tokens_per_step": metrics.tokens_per_step,
        "mean_step_ms": ms / len(times) if times else 0.0,
        "bytes_up_per_step": sum(t.bytes_up for t in times) / len(times) if times else 0.0,
        "bytes_down_per_step": sum(t.bytes_down for t in times) / len(times) if times else 0.0,
    }


def sealing_us(up: int, down: int, repeats: int = 2000) -> float:
    """Median µs to seal and open one step's frames of these sizes, both directions (both sides' work)."""
    client, server = SealedChannel(b"u" * 32, b"d" * 32), SealedChannel(b"d" * 32, b"u" * 32)
    request, reply = os.urandom(up), os.urandom(down)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        server.open(client.seal(request))
        client.open(server.seal(reply))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _handshake_ms(client: SplitClient, url: str, options: ConnectionOptions) -> float:
    """Median ms from nothing to an opened session (connect, attest when sealed, open), then closed."""
    times = []
    for _ in range(HANDSHAKES):
        t0 = time.perf_counter()
        middle = RemoteMiddle(url, client.files.fingerprint, client.client_model.middle_range, client.wire_dtype, 512,
                              options)
        times.append((time.perf_counter() - t0) * 1000)
        middle.close()
    return statistics.median(times)


def measure_model(
    model: str, rtts: Sequence[float], prompts_per_category: int, max_new_tokens: int, modes: Sequence[str],
    core_layout: str, progress: Callable[[str], None],
) -> list[dict]:
    """One row per RTT and decoding mode: plain and sealed decoding of the same prompts, the handshakes,
    the sealing."""
    cores = sides(core_layout)
    set_compute_threads(cores.threads)
    precision = fastest()
    prompts = [p.text for p in workload(prompts_per_category)]
    rows = []
    with tempfile.TemporaryDirectory() as vendor:
        options = {"plain": ConnectionOptions(),
                   "sealed": ConnectionOptions(attestation=AttestationPolicy.load(sim_init(vendor)))}
        client = SplitClient(model, wire_dtype="float16", precision=precision)
        serve = ("--model", model, "--threads", str(cores.threads), *precision.serve_args())
        attested = ("--attestation", "simulated", "--attestation-sim", vendor)
        with (
            ServerProcess(*serve, cores=cores.server) as plain,
            ServerProcess(*serve, *attested, cores=cores.server) as sealed,
            on_cores(cores.client),
        ):
            for rtt in rtts:
                link = LinkProfile(rtt_ms=rtt)
                with (
                    ProxyThread("127.0.0.1", plain.port, link) as p, ProxyThread("127.0.0.1", sealed.port, link) as s,
                    compute_threads_pinned(),
                ):
                    urls = {"plain": f"ws://127.0.0.1:{p.port}", "sealed": f"ws://127.0.0.1:{s.port}"}
                    for mode in modes:
                        row = _measure_link(client, urls, options, prompts, max_new_tokens, mode, progress)
                        rows.append(row | {"rtt_ms": rtt, "decode": mode})
                        progress(f"{model} at {rtt:g} ms, {mode}: sealed {row['ratio']:.3f}x plain")
    for row in rows:
        row["sealing_us_per_step"] = sealing_us(round(row["sealed"]["bytes_up_per_step"]),
                                                round(row["sealed"]["bytes_down_per_step"]))
    return [{"model": model, "precision": precision.name, **row} for row in rows]


def _measure_link(
    client: SplitClient, urls: dict[str, str], options: dict[str, ConnectionOptions], prompts: Sequence[str],
    max_new_tokens: int, decode: str, progress: Callable[[str], None],
) -> dict:
    gens: dict[str, list[Generation]] = {k: [] for k in KINDS}
    for i, prompt in enumerate(["warm-up", *prompts]):
        for kind in KINDS if i % 2 else reversed(KINDS):
            client.server, client.connection = urls[kind], options[kind]
            gen = client.generate(prompt, 4 if i == 0 else max_new_tokens, decode)
            if i:
                gens[kind].append(gen)
        if i:
            progress(f"prompt {i}: plain {gens['plain'][-1].tokens_per_second:.2f} tok/s, "
                     f"sealed {gens['sealed'][-1].tokens_per_second:.2f}")
    plain, sealed = _decode_totals(gens["plain"]), _decode_totals(gens["sealed"])
    handshake = {kind: _handshake_ms(client, urls[kind], options[kind]) for kind in KINDS}
    return {
        "plain": plain,
        "sealed": sealed,
        "ratio": sealed["tokens_per_second"] / plain["tokens_per_second"] if plain["tokens_per_second"] else 0.0,
        "identical": sum(a.ids == b.ids for a, b in zip(gens["plain"], gens["sealed"])),
        "prompts": len(prompts),
        "open_ms": handshake["plain"],
        "attest_and_open_ms": handshake["sealed"],
    }


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [
        f"{s['max_new_tokens']} new tokens, {s['prompts_per_category']} prompts per category, each side on its own "
        f"cores ({s['core_layout']}); attested with the simulated vendor. {result['provenance']['date'][:10]}, "
        f"`{result['provenance']['git_commit'][:10]}`, {result['provenance']['cpu']}.",
        "",
        "| model | RTT ms | decoding | plain tok/s | sealed tok/s | sealed / plain | tokens per step, plain / sealed "
        "| identical | connect + open ms | connect + attest + open ms | sealing µs per step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['model']} | {r['rtt_ms']:g} | {r['decode']} | {r['plain']['tokens_per_second']:.2f} "
            f"| {r['sealed']['tokens_per_second']:.2f} "
            f"| {r['ratio']:.3f}x | {r['plain']['tokens_per_step']:.2f} / {r['sealed']['tokens_per_step']:.2f} "
            f"| {r['identical']}/{r['prompts']} | {r['open_ms']:.1f} | {r['attest_and_open_ms']:.1f} "
            f"| {r['sealing_us_per_step']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def run_confidential(
    models: Sequence[str], rtts: Sequence[float], prompts_per_category: int, max_new_tokens: int, modes: Sequence[str],
    core_layout: str, progress: Callable[[str], None],
) -> dict:
    rows = [row for model in models for row in measure_model(
        model, rtts, prompts_per_category, max_new_tokens, modes, core_layout, progress
    )]
    settings = {"models": list(models), "rtts_ms": list(rtts), "prompts_per_category": prompts_per_category,
                "max_new_tokens": max_new_tokens, "decode": list(modes), "core_layout": core_layout}
    return {"settings": settings, "rows": rows}

