"""`make demo`: a server, an 80 ms WAN link and a client on loopback, streaming one answer."""

from __future__ import annotations

import sys

import torch
from rich.console import Console
from rich.table import Table

from splitllm.client.session import SplitClient
from splitllm.launch import ServerProcess
from splitllm.model.precision import FASTEST, Precision
from splitllm.netem import LinkProfile, ProxyThread

DEMO_PROMPT = "Explain in a few sentences why the sky is blue."


def run_demo(
    prompt: str = DEMO_PROMPT,
    rtt_ms: float = 80.0,
    max_new_tokens: int = 96,
    decode: str = "sequential",
    precision: Precision = Precision.from_name(FASTEST),
) -> None:
    console = Console(stderr=True)
    torch.set_num_threads(1)
    console.print("[bold]splitllm demo[/]: loading the client side of the default model (first run converts it once)")
    client = SplitClient(None, head=2, tail=2, dtype=precision)
    with ServerProcess("--head", "2", "--tail", "2", *precision.serve_args()) as server:
        console.print(f"server: layers {list(client.local.middle_range)} on {server.url}, both sides {precision.name}")
        with ProxyThread("127.0.0.1", server.port, LinkProfile(rtt_ms=rtt_ms)) as proxy:
            client.server = f"ws://127.0.0.1:{proxy.port}"
            console.print(f"WAN proxy: {rtt_ms:.0f} ms RTT on port {proxy.port}\n[bold]prompt[/]: {prompt}\n")
            printed = ""
            gen = None
            for gen, _ in client.stream(prompt, max_new_tokens, decode):
                text = client.tokenizer.decode(gen.ids, skip_special_tokens=True)
                sys.stdout.write(text[len(printed) :])
                sys.stdout.flush()
                printed = text
    sys.stdout.write("\n")
    assert gen is not None
    summary = gen.summary()
    table = Table(title=f"per-step means over {len(gen.steps) - 1} decode steps ({decode})")
    for column in ("tok/s", "tok/step", "step ms", "client ms", "network ms", "server ms", "bytes up/down"):
        table.add_column(column, justify="right")
    m = summary["mean_step"]
    table.add_row(
        f"{summary['tokens_per_second']:.2f}",
        f"{summary['tokens_per_step']:.2f}",
        f"{m['total_ms']:.1f}",
        f"{m['client_ms']:.1f}",
        f"{m['network_ms']:.1f}",
        f"{m['server_ms']:.1f}",
        f"{m['bytes_up']:.0f}/{m['bytes_down']:.0f}",
    )
    console.print(table)
