"""`make demo`: a server, an 80 ms WAN link and a client on loopback. It streams one answer with the
chosen mode (`auto` by default), then decodes the same prompt sequentially and shows both speeds."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from splitllm.client.client import Generation, SplitClient
from splitllm.decoding.mode_names import DEFAULT_DECODE
from splitllm.lab.data.workload import DEMO_PROMPT
from splitllm.testing.launch import ServerProcess
from splitllm.model.precision import Precision, fastest
from splitllm.testing.netem import LinkProfile, ProxyThread
from splitllm.threads import set_compute_threads

BASELINE = "sequential"  # one token per round trip: what every other mode must reproduce, faster


def run_demo(
    prompt: str = DEMO_PROMPT,
    rtt_ms: float = 80.0,
    max_new_tokens: int = 96,
    decode: str = DEFAULT_DECODE,
    precision: Precision | None = None,
) -> None:
    console = Console(stderr=True)
    set_compute_threads(1)
    precision = precision or fastest()
    console.print("[bold]splitllm demo[/]: loading the client side of the default model (first run converts it once)")
    client = SplitClient(None, first=2, last=2, precision=precision)
    runs: dict[str, Generation] = {}
    with ServerProcess("--first", "2", "--last", "2", *precision.serve_args()) as server:
        start, end = client.client_model.middle_range
        console.print(f"server: layers [{start}, {end}) on {server.url}, both sides {precision.name}")
        with ProxyThread("127.0.0.1", server.port, LinkProfile(rtt_ms=rtt_ms)) as proxy:
            client.server = f"ws://127.0.0.1:{proxy.port}"
            console.print(f"WAN proxy: {rtt_ms:.0f} ms RTT on port {proxy.port}\n[bold]prompt[/]: {prompt}\n")
            printed = ""
            for gen, _ in client.stream(prompt, max_new_tokens, decode):
                sys.stdout.write(gen.text[len(printed) :])
                sys.stdout.flush()
                printed = gen.text
            runs[decode] = gen
            sys.stdout.write("\n\n")
            if decode != BASELINE:
                console.print(f"the same prompt with {BASELINE} decoding, for comparison…")
                runs[BASELINE] = client.generate(prompt, max_new_tokens, BASELINE)
    console.print(_table(runs, rtt_ms))
    if len(runs) > 1:
        same = runs[decode].ids == runs[BASELINE].ids
        speedup = runs[decode].tokens_per_second / max(runs[BASELINE].tokens_per_second, 1e-9)
        verdict = "the same answer" if same else "answers differ (a near-tie in the logits; see docs/correctness.md)"
        console.print(f"[bold]{decode}[/] is {speedup:.2f}x as fast as {BASELINE}, with {verdict}.")


def _table(runs: dict[str, Generation], rtt_ms: float) -> Table:
    """Per-step means of each run, side by side."""
    table = Table(title=f"the same answer over a {rtt_ms:.0f} ms link (per decode step: mean ms)")
    for column in ("mode", "tok/s", "tok/step", "steps", "step", "client", "network", "server"):
        table.add_column(column, justify="right", no_wrap=True)
    for mode, gen in runs.items():
        m = gen.summary()["mean_step"]
        table.add_row(
            mode,
            f"{gen.tokens_per_second:.2f}",
            f"{gen.tokens_per_step:.2f}",
            str(len(gen.steps)),
            f"{m.get('total_ms', 0):.1f}",
            f"{m.get('client_ms', 0):.1f}",
            f"{m.get('network_ms', 0):.1f}",
            f"{m.get('server_ms', 0):.1f}",
        )
    return table
