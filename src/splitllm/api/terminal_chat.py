"""`splitllm chat`: a terminal conversation whose turns reuse the KV cache.

Each turn sends the server only its own tokens (the previous answer's last token, the user's
message in the chat template, the assistant prompt); earlier turns stay in every stage's cache.
"""

from __future__ import annotations

from collections.abc import Callable

from rich.console import Console
from rich.table import Table

from splitllm.client.connection import CLIENT_ERRORS
from splitllm.client.client import Generation, SplitClient
from splitllm.decoding.mode_names import DEFAULT_DECODE
from splitllm.decoding.sampling import SamplingParams
from splitllm.stats import mean_stats

HELP = "commands: /stats (per-turn statistics), /reset (forget the conversation), /quit"


def status_line(gen: Generation, context: int) -> str:
    """Speed of one answer: decode tok/s, tokens per round trip, the mean round trip."""
    steps = gen.steps[1:] or gen.steps
    rtt = mean_stats(steps).get("round_trip_ms", 0.0)
    return (
        f"[{len(gen.ids)} tokens · {gen.tokens_per_second:.1f} tok/s · {gen.tokens_per_step:.2f} tok/step · "
        f"RTT {rtt:.0f} ms · context {context}]"
    )


def stats_table(turns: list[Generation]) -> Table:
    table = Table(title="turns of this conversation")
    for column in ("turn", "sent", "answer", "steps", "tok/s", "tok/step", "step ms", "RTT ms", "server ms"):
        table.add_column(column, justify="right")
    for i, gen in enumerate(turns, 1):
        m = mean_stats(gen.steps[1:] or gen.steps)
        table.add_row(
            str(i),
            str(gen.steps[0].timing.nodes if gen.steps else 0),
            str(len(gen.ids)),
            str(len(gen.steps)),
            f"{gen.tokens_per_second:.1f}",
            f"{gen.tokens_per_step:.2f}",
            f"{m.get('total_ms', 0):.0f}",
            f"{m.get('round_trip_ms', 0):.0f}",
            f"{m.get('server_ms', 0):.0f}",
        )
    return table


def run_chat(
    client: SplitClient,
    decode: str = DEFAULT_DECODE,
    sampling: SamplingParams | None = None,
    max_new_tokens: int = 256,
    system: str | None = None,
    read: Callable[[str], str] = input,
    console: Console | None = None,
) -> None:
    """Read lines until /quit or end of input; answer each one, streaming, then a status line."""
    client.check_chat()
    console = console or Console(highlight=False)
    conv = client.conversation(system)
    turns: list[Generation] = []
    where = client.server or "in-process middle"
    console.print(f"splitllm chat · {client.files.path.name} · {where} · {decode}\n{HELP}", style="dim")
    try:
        while True:
            try:
                line = read(">>> ").strip()
            except (EOFError, KeyboardInterrupt):
                console.print()
                return
            if line == "/quit":
                return
            if line == "/reset":
                conv.close()
                turns.clear()
                console.print("[conversation reset]", style="dim", markup=False)
            elif line == "/stats":
                console.print(stats_table(turns) if turns else "no turns yet", style="dim")
            elif line.startswith("/"):
                console.print(f"unknown command {line}; {HELP}", style="dim", markup=False)
            elif line:
                gen = _answer(console, conv, line, decode, sampling, max_new_tokens)
                if gen is not None:
                    turns.append(gen)
                    console.print(status_line(gen, len(conv.ids)), style="dim", markup=False)
    finally:
        conv.close()


def _answer(console, conv, line, decode, sampling, max_new_tokens) -> Generation | None:
    """Stream one answer; Ctrl-C stops it (between steps the conversation keeps what was said)."""
    gen, shown = None, ""
    try:
        for gen, _ in conv.say(line, max_new_tokens, decode, sampling):
            console.file.write(gen.text[len(shown) :])
            console.file.flush()
            shown = gen.text
    except KeyboardInterrupt:
        console.print("\n[interrupted]", style="dim", markup=False)
        if not conv.ids:  # stopped inside a step: the caches were dropped
            console.print("[the conversation starts afresh]", style="dim", markup=False)
            return None
    except CLIENT_ERRORS as exc:
        console.print(f"\nerror: {exc}\n[the conversation starts afresh]", style="red", markup=False)
        return None
    console.file.write("\n")
    return gen
