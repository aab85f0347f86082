"""`splitllm bench defaults`: `splitllm serve` and `splitllm generate` as a user first runs them, with no
precision or thread options, against the fastest setting named explicitly, in one run.

Every setup keeps its own server process up for the whole run and the prompts alternate between the
setups, so a disturbance of the shared machine falls on all of them alike. Each generation is a fresh
`splitllm generate --json` process, as a user's is; its decode speed (tokens after the first over the
steps after the prefill) is what is compared.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from splitllm.lab.data.workload import workload
from splitllm.lab.launch import ServerProcess
from splitllm.lab.netem import LinkProfile, ProxyThread
from splitllm.model.precision import fastest

def setups() -> dict[str, list[str]]:
    """name -> the options both commands get: none, the fastest setting by name, and that with one
    thread per process (client and server share this machine's cores)."""
    named = ["--dtype", str(fastest().dtype).removeprefix("torch."), "--quant", fastest().quant]
    return {"defaults": [], f"{fastest().name}": named, f"{fastest().name}, 1 thread each": [*named, "--threads", "1"]}


def _generate(url: str, prompt: str, tokens: int, options: list[str]) -> dict:
    run = subprocess.run(
        [sys.executable, "-m", "splitllm.cli", "generate", prompt, "--server", url, "--json",
         "--max-new-tokens", str(tokens), *options],
        capture_output=True, text=True, timeout=600, check=True,
    )
    return json.loads(run.stdout.strip().splitlines()[-1])


def run_defaults(
    out: str, per_category: int = 1, tokens: int = 64, rtt_ms: float = 0.0, progress: Callable[[str], None] = print
) -> dict:
    """Measure every setup on the same prompts; write OUT/defaults.json and defaults.md."""
    prompts = [p.text for p in workload(per_category)]
    options = setups()
    runs: dict[str, list[dict]] = {name: [] for name in options}
    with ExitStack() as stack:
        urls = {}
        for name, opts in options.items():
            server = stack.enter_context(ServerProcess(*opts))
            proxy = stack.enter_context(ProxyThread("127.0.0.1", server.port, LinkProfile(rtt_ms=rtt_ms)))
            urls[name] = f"ws://127.0.0.1:{proxy.port}"
        for i, prompt in enumerate(prompts):
            for name, opts in options.items():
                summary = _generate(urls[name], prompt, tokens, opts)
                runs[name].append({k: summary[k] for k in ("ids", "tokens_per_second", "tokens_per_step")})
                progress(f"  prompt {i + 1}/{len(prompts)} {name}: {summary['tokens_per_second']:.1f} tok/s")
    rows = {
        name: {
            "tokens_per_second": statistics.fmean(r["tokens_per_second"] for r in rs),
            "tokens_per_step": statistics.fmean(r["tokens_per_step"] for r in rs),
        }
        for name, rs in runs.items()
    }
    best = max(rows.values(), key=lambda r: r["tokens_per_second"])["tokens_per_second"]
    for row in rows.values():
        row["vs_best"] = row["tokens_per_second"] / best
    result = {
        "prompts": len(prompts), "max_new_tokens": tokens, "rtt_ms": rtt_ms, "fastest": fastest().name,
        "setups": options, "rows": rows,
        "same_output": all(r["ids"] == runs["defaults"][i]["ids"] for rs in runs.values() for i, r in enumerate(rs)),
    }
    lines = [f"`splitllm serve` + `splitllm generate`, {len(prompts)} prompts x {tokens} tokens at {rtt_ms:.0f} ms "
             f"added RTT, mean decode speed (the fastest here: {fastest().name}):", "",
             "| setup | options | tok/s | tok/step | vs best |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {name} | `{' '.join(options[name]) or '(none)'}` | {r['tokens_per_second']:.2f} | "
              f"{r['tokens_per_step']:.2f} | {r['vs_best']:.3f} |" for name, r in rows.items()]
    lines += ["", f"Every setup's output identical to the defaults': {result['same_output']}."]
    result["markdown"] = "\n".join(lines)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "defaults.json").write_text(json.dumps({k: v for k, v in result.items() if k != "markdown"}, indent=1))
    (folder / "defaults.md").write_text(result["markdown"] + "\n")
    return result
