"""`splitllm bench defaults`: `splitllm serve` and `splitllm generate` as a user first runs them, with no
precision or thread options, against the fastest setting and thread count named explicitly, in one run.

A deployment has two machines; here client and server share one. So each side is pinned to its own
half of the cores (the defaults then see only those and take their thread count from them), and the
same defaults with both processes on every core are measured beside them: what sharing the machine
costs, kept out of the comparison. Every setup keeps its own server process up for the whole run and
the prompts alternate between setups, so a disturbance of the machine falls on all of them alike. Each
generation is a fresh `splitllm generate --json` process, as a user's is; its decode speed (tokens
after the first over the steps after the prefill) is what is compared.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from splitllm.lab.data.workload import workload
from splitllm.testing.launch import ServerProcess, pinned, split_cores
from splitllm.testing.netem import LinkProfile, ProxyThread
from splitllm.model.precision import fastest


@dataclass(frozen=True)
class Setup:
    """The options both commands get, and the cores of the server and of the client (None: all)."""

    options: tuple[str, ...]
    server_cores: set[int] | None
    client_cores: set[int] | None


def setups() -> dict[str, Setup]:
    server, client = split_cores()
    fast = fastest()
    named = ("--dtype", fast.dtype_name, "--quant", fast.quant, "--threads", str(len(server)))
    return {
        "defaults, a side per core set": Setup((), server, client),
        f"{fast.name} and --threads named, a side per core set": Setup(named, server, client),
        "defaults, both sides on every core": Setup((), None, None),
    }


def _generate(url: str, prompt: str, tokens: int, setup: Setup) -> dict:
    run = subprocess.run(
        [sys.executable, "-m", "splitllm.cli", "generate", prompt, "--server", url, "--json",
         "--max-new-tokens", str(tokens), *setup.options],
        capture_output=True, text=True, timeout=600, check=True, preexec_fn=pinned(setup.client_cores),
    )
    return json.loads(run.stdout.strip().splitlines()[-1])


def run_defaults(
    out: str, per_category: int = 1, tokens: int = 64, rtt_ms: float = 0.0, progress: Callable[[str], None] = print
) -> dict:
    """Measure every setup on the same prompts; write OUT/defaults.json and defaults.md."""
    prompts = [p.text for p in workload(per_category)]
    chosen = setups()
    runs: dict[str, list[dict]] = {name: [] for name in chosen}
    with ExitStack() as stack:
        urls = {}
        for name, setup in chosen.items():
            server = stack.enter_context(ServerProcess(*setup.options, cores=setup.server_cores))
            proxy = stack.enter_context(ProxyThread("127.0.0.1", server.port, LinkProfile(rtt_ms=rtt_ms)))
            urls[name] = f"ws://127.0.0.1:{proxy.port}"
        for i, prompt in enumerate(prompts):
            for name, setup in chosen.items():
                summary = _generate(urls[name], prompt, tokens, setup)
                runs[name].append({k: summary[k] for k in ("ids", "tokens_per_second", "tokens_per_step")})
                progress(f"  prompt {i + 1}/{len(prompts)} {name}: {summary['tokens_per_second']:.1f} tok/s")
    rows = {
        name: {
            "tokens_per_second": statistics.fmean(r["tokens_per_second"] for r in rs),
            "tokens_per_step": statistics.fmean(r["tokens_per_step"] for r in rs),
        }
        for name, rs in runs.items()
    }
    defaults, named = list(rows.values())[:2]  # the setups' order: the defaults, then the setting named
    for row in rows.values():
        row["vs_named"] = row["tokens_per_second"] / named["tokens_per_second"]
    reference = runs[next(iter(runs))]
    result = {
        "prompts": len(prompts), "max_new_tokens": tokens, "rtt_ms": rtt_ms, "fastest": fastest().name,
        "setups": {n: {"options": list(s.options), "server_cores": sorted(s.server_cores or []),
                       "client_cores": sorted(s.client_cores or [])} for n, s in chosen.items()},
        "rows": rows, "defaults_vs_named": defaults["vs_named"],
        "same_output": all(r["ids"] == reference[i]["ids"] for rs in runs.values() for i, r in enumerate(rs)),
    }
    lines = [f"`splitllm serve` + `splitllm generate`, {len(prompts)} prompts x {tokens} tokens at {rtt_ms:.0f} ms "
             f"added RTT, mean decode speed (the fastest here: {fastest().name}):", "",
             "| setup | options | tok/s | tok/step | vs named |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {name} | `{' '.join(chosen[name].options) or '(none)'}` | {r['tokens_per_second']:.2f} | "
              f"{r['tokens_per_step']:.2f} | {r['vs_named']:.3f} |" for name, r in rows.items()]
    lines += ["", f"Every setup's output identical: {result['same_output']}."]
    result["markdown"] = "\n".join(lines)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "defaults.json").write_text(json.dumps({k: v for k, v in result.items() if k != "markdown"}, indent=1))
    (folder / "defaults.md").write_text(result["markdown"] + "\n")
    return result
