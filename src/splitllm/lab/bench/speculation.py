"""`splitllm bench speculation`: tokens per round trip and speed of each decoding mode over an emulated WAN.

A real server subprocess sits behind the WAN proxy; for every prompt the modes run back to back
(sequential first), so a disturbance of the shared machine hits them alike and speedups are ratios
measured in the same run. Decode-phase numbers exclude the prefill step, as `Generation` does.
"""

from __future__ import annotations

import functools
import json
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from splitllm.lab.bench.exactness import first_difference, top2_gap
from splitllm.lab.data.workload import CATEGORIES, workload
from splitllm.client.client import SplitClient
from splitllm.decoding.sampling import SamplingParams
from splitllm.decoding.sizing.budget import SpecBudget
from splitllm.decoding.sizing.latency import tokens_per_second
from splitllm.decoding.modes import DECODERS
from splitllm.decoding.mode_names import Mode
from splitllm.decoding.speculation_config import SpeculationConfig, TreeShape
from splitllm.decoding.speculative import SpeculativeDecoder
from splitllm.drafting.draft_model import DraftModel
from splitllm.drafting.drafter import Drafter
from splitllm.lab import peers
from splitllm.testing.launch import ServerProcess, Sides, on_cores, sides
from splitllm.kernels import cpu_kernels
from splitllm.model.precision import Precision, fastest
from splitllm.model.stage import Stage
from splitllm.testing.netem import LinkProfile, ProxyThread
from splitllm.stats import SpeculationMetrics, StepStats
from splitllm.threads import compute_threads_pinned, set_compute_threads

MODES = ("sequential", "lookup", "lookahead", "drafter", "auto", "auto-static")
# Decoders measured besides DECODERS' modes: `auto` with its static default budget instead of the
# adaptive policy, to show what adapting to the link adds; `drafter` with trees of about the size EAGLE-2
# verifies (64 nodes, 8 beams of 8 children, 10 deep) against its own 24 nodes of 4 x 6, to show what
# width buys and costs; `auto` choosing its value-sized trees from 8 x 8 candidates instead of 4 x 6;
# `auto` drafting only between steps (no tree prepared while one is in flight), to show what that hides; and
# `auto` preparing trees in flight but sending none ahead (one step on the wire at a time), to show what
# sending the next step on the likely outcome of the one in flight adds.
WIDE = TreeShape(top_k=8, beam=8)
EXTRA_DECODERS: dict[str, Callable[[], Callable]] = {
    "auto-static": lambda: SpeculativeDecoder(SpeculationConfig()),
    "drafter-wide": lambda: SpeculativeDecoder(
        SpeculationConfig(Mode.DRAFTER, drafter_budget=SpecBudget(max_nodes=64, guesses=3, depth=10), tree=WIDE)
    ),
    "auto-wide": lambda: SpeculativeDecoder(replace(DECODERS[Mode.AUTO]().config, tree=WIDE)),
    "auto-serial": lambda: SpeculativeDecoder(replace(DECODERS[Mode.AUTO]().config, prepare=False)),
    "auto-one-step": lambda: SpeculativeDecoder(replace(DECODERS[Mode.AUTO]().config, send_ahead=False)),
}
# llama.cpp running the whole model here, by its thread count: one thread on the client's cores (what the
# client alone could run without any server), two on both sides' cores (the cores the split run uses).
WHOLE_MODEL_THREADS = (1, 2)


@dataclass
class Tally:
    """The decode-phase steps of one mode over some prompts (a run's steps as `measure` records them)."""

    prompts: int = 0
    identical: int = 0
    first_step_ms: float = 0.0  # the prefill steps' time: the first token's wait, the prompt read by every side
    steps: list[StepStats] = field(default_factory=list)
    client_cpu_ms: float = 0.0  # the client process's CPU time over whole generations (prompt included)
    generated: int = 0

    def add(self, run: dict, identical: bool) -> None:
        steps = [StepStats.from_flat(s) for s in run["steps"]]
        self.client_cpu_ms += run.get("client_cpu_ms", 0.0)
        self.generated += len(run["ids"])
        self.prompts += 1
        self.identical += identical
        self.first_step_ms += steps[0].timing.total_ms if steps else 0.0
        self.steps += steps[1:]

    def summary(self, sequential: Tally | None) -> dict:
        metrics = SpeculationMetrics.of(self.steps)
        times, specs = [s.timing for s in self.steps], [s.speculation for s in self.steps]
        ms = sum(t.total_ms for t in times)
        server_ms = sum(t.server_ms for t in times)
        tps = tokens_per_second(self.steps)
        base = tokens_per_second(sequential.steps) if sequential else 0.0
        per_step = lambda x: x / metrics.steps if metrics.steps else 0.0  # noqa: E731
        won = Counter(s.proposer for s in specs if s.proposer)  # proposer -> steps its draft won
        accepted_drafts: Counter[str] = Counter()  # proposer -> its draft tokens emitted (a stop may clip them)
        for s in specs:
            if s.proposer:
                accepted_drafts[s.proposer] += s.accepted - 1
        prepared, adopted = sum(s.prepared for s in specs), sum(s.adopted for s in specs)
        sent_ahead, ran_ahead = sum(s.sent_ahead for s in specs), sum(s.ran_ahead for s in specs)
        return {
            "prompts": self.prompts,
            "identical": self.identical,
            "tokens": metrics.tokens,
            "steps": metrics.steps,
            "tokens_per_step": metrics.tokens_per_step,
            "tokens_per_second": tps,
            "speedup": tps / base if base else 0.0,
            "mean_step_ms": per_step(ms),
            "nodes_per_step": per_step(sum(t.nodes for t in times)),
            "bytes_up_per_step": per_step(sum(t.bytes_up for t in times)),
            "bytes_down_per_step": per_step(sum(t.bytes_down for t in times)),
            "draft_ms_per_step": per_step(sum(t.draft_ms for t in times)),  # the drafter, on the critical path
            "server_ms_per_step": per_step(server_ms),
            "server_busy": server_ms / ms if ms else 0.0,  # of the decode's wall time
            "hidden_ms_per_step": per_step(sum(t.overlap_ms for t in times)),  # client work while steps were in flight
            "prepared_share": per_step(prepared),  # steps whose flight prepared the next tree
            "adopted_share": adopted / prepared if prepared else 0.0,  # prepared trees used
            "ahead_share": per_step(sent_ahead),  # steps that sent the next step before their reply came back
            "ahead_used_share": ran_ahead / sent_ahead if sent_ahead else 0.0,  # steps sent ahead whose guess held
            "first_step_ms": self.first_step_ms / self.prompts if self.prompts else 0.0,
            # what the device pays: the client process's CPU time (its WAN proxy thread included) per token
            "client_cpu_ms_per_token": self.client_cpu_ms / self.generated if self.generated else 0.0,
            "proposers": {p: {"steps_won": won[p], "draft_tokens_accepted": accepted_drafts[p]} for p in sorted(won)},
            # share of all emitted tokens that were draft tokens of nodes with these sources ("a+b": both)
            "sources": {
                src: {"draft_tokens_accepted": n, "share": n / metrics.tokens if metrics.tokens else 0.0}
                for src, n in sorted(metrics.sources.items())
            },
        }


def measure(
    client: SplitClient, prompts: Sequence[tuple[str, str]], max_new_tokens: int, modes: Sequence[str],
    progress: Callable[[str], None] = lambda _: None, sampling: SamplingParams | None = None,
) -> list[dict]:
    """One record per (prompt, mode): ids and per-step stats, modes back to back for each prompt. Each
    mode keeps one decoder across the prompts, as the client keeps its own modes' (what sizing and the
    gates learned carries from one prompt to the next alike)."""
    decoders = {mode: EXTRA_DECODERS[mode]() if mode in EXTRA_DECODERS else mode for mode in modes}
    runs = []
    for i, (category, text) in enumerate(prompts):
        for mode in modes:
            cpu = time.process_time()
            gen = client.generate(text, max_new_tokens, decode=decoders[mode], sampling=sampling)
            cpu_ms = (time.process_time() - cpu) * 1000
            steps = [s.as_dict() for s in gen.steps]
            runs.append({"prompt": i, "category": category, "mode": mode, "ids": gen.ids, "steps": steps,
                         "client_cpu_ms": cpu_ms})
            progress(f"{category} #{i} {mode}: {len(gen.ids)} tokens, {gen.tokens_per_step:.2f} tok/step, "
                     f"{gen.tokens_per_second:.2f} tok/s")
    return runs


def divergences(client: SplitClient, prompts: Sequence[tuple[str, str]], runs: Sequence[dict]) -> list[dict]:
    """Where each run that differs from sequential first differs, with the model's top-2 logit gap there
    (recomputed in float32 without the wire): near-ties are rounding, anything else would be a bug."""
    middle = Stage.load(client.files, *client.client_model.middle_range, client.precision)
    reference = {r["prompt"]: r["ids"] for r in runs if r["mode"] == "sequential"}
    found = []
    for r in runs:
        i = first_difference(reference[r["prompt"]], r["ids"])
        if i is not None:
            prefix = client.encode_prompt(prompts[r["prompt"]][1]) + reference[r["prompt"]][:i]
            found.append({"prompt": r["prompt"], "mode": r["mode"], "index": i,
                          "gap": top2_gap(client.client_model, middle, prefix)})
    return found


def summarize(runs: Sequence[dict], modes: Sequence[str]) -> dict:
    """Per category and overall, per mode; identical = same ids as sequential on that prompt."""
    reference = {r["prompt"]: r["ids"] for r in runs if r["mode"] == "sequential"}
    groups: dict[str, dict[str, Tally]] = defaultdict(lambda: defaultdict(Tally))
    for r in runs:
        same = r["ids"] == reference.get(r["prompt"])
        for group in (r["category"], "overall"):
            groups[group][r["mode"]].add(r, same)
    order = [c for c in CATEGORIES if c in groups] + ["overall"]
    return {g: {m: groups[g][m].summary(groups[g].get("sequential")) for m in modes if m in groups[g]} for g in order}


def _cores(cores: dict) -> str:
    threads = f"{cores['threads']} thread{'s' * (cores['threads'] > 1)} a side"
    if cores["layout"] == "alternate":
        return f"{threads}, both sides on every core computing in turn (two machines of this size)"
    return f"{threads}, each side pinned to its own cores"


def _drafting(drafter: Drafter | None, draft_model: DraftModel | None, folder: str | None) -> str:
    """What drafts, for the report: the draft model's folder name and precision, and the drafter's folder
    ("shipped": the package's)."""
    names = (
        [f"draft model {draft_model.files.path.name} in {draft_model.precision.name}"]
        if draft_model is not None
        else []
    )
    return ", ".join(names + ([f"drafter {folder or 'shipped'}"] if drafter is not None else []))


def _modes_table(summary: dict) -> list[str]:
    """The per-mode table; the sent-ahead column only when the summaries have it (older results predate it)."""
    ahead = any("ahead_share" in s for modes in summary.values() for s in modes.values())
    lines = [
        "| category | mode | tokens/step | tok/s | speedup vs sequential | identical | nodes/step | bytes up/step "
        "| draft ms/step | hidden ms/step | prepared trees used |" + (" steps sent ahead used |" if ahead else "")
        + " server busy | server ms/step | first token ms |",
        "| --- " * (15 if ahead else 14) + "|",
    ]
    for group, modes in summary.items():
        for mode, s in modes.items():
            sent = f" {s.get('ahead_used_share', 0.0):.0%} of {s.get('ahead_share', 0.0):.0%} |" if ahead else ""
            lines.append(
                f"| {group} | {mode} | {s['tokens_per_step']:.2f} | {s['tokens_per_second']:.2f} | "
                f"{s['speedup']:.2f}x | {s['identical']}/{s['prompts']} | {s['nodes_per_step']:.1f} | "
                f"{s['bytes_up_per_step']:.0f} | {s['draft_ms_per_step']:.1f} | {s['hidden_ms_per_step']:.1f} | "
                f"{s['adopted_share']:.0%} of {s['prepared_share']:.0%} |{sent} {s['server_busy']:.0%} | "
                f"{s['server_ms_per_step']:.1f} | {s['first_step_ms']:.0f} |"
            )
    return lines


def markdown(summary: dict, settings: dict) -> str:
    lines = [
        f"Speculative decoding over an emulated WAN: {settings['rtt_ms']:g} ms RTT, "
        f"{settings.get('model', 'default')} model split "
        f"{settings['first']}+{settings['last']} (client) / server middle, {settings['max_new_tokens']} new tokens, "
        f"{settings['prompts_per_category']} prompts per category, {_cores(settings['cores'])}, "
        f"{settings.get('wire_dtype', 'float16')} wire, sampling {settings.get('sampling') or 'greedy'}"
        f"{', drafting with ' + settings['drafter'] if settings.get('drafter') else ''}.",
        "",
        *_modes_table(summary),
    ]
    lines += [
        "",
        "Accepted draft tokens by proposer (overall):",
        "",
        "| mode | proposer | steps won | draft tokens accepted | share of tokens |",
        "| --- | --- | --- | --- | --- |",
    ]
    for mode, s in summary["overall"].items():
        for proposer, p in s["proposers"].items():
            share = p["draft_tokens_accepted"] / s["tokens"] if s["tokens"] else 0.0
            lines.append(f"| {mode} | {proposer} | {p['steps_won']} | {p['draft_tokens_accepted']} | {share:.1%} |")
    lines += [
        "",
        "Share of emitted tokens that were accepted draft tokens, by the sources of their tree node "
        "(a+b: both proposed it; the rest of the tokens are each step's bonus token):",
        "",
        "| category | mode | source | draft tokens accepted | share of tokens |",
        "| --- | --- | --- | --- | --- |",
    ]
    for group, modes in summary.items():
        for mode, s in modes.items():
            for source, p in s.get("sources", {}).items():
                lines.append(f"| {group} | {mode} | {source} | {p['draft_tokens_accepted']} | {p['share']:.1%} |")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class SpeculationBench:
    """What `run_speculation` measures: the workload, the link, the split, the precision and what drafts.

    `drafter`: a drafter folder (default: the one shipped for the model); without any drafter the
    `drafter` mode is left out and `auto` drafts with n-gram sources only. `draft_model`: a smaller model
    with the same tokenizer drafting instead of a drafter (default: the model's packaged one, if any;
    "none": none), as `SplitClient` takes them. `core_layout` names the cores of each side (launch.sides).
    """

    prompts_per_category: int = 3
    max_new_tokens: int = 200
    rtt_ms: float = 80.0
    modes: tuple[str, ...] = MODES
    out: str | Path = "results"
    first: int = 2
    last: int = 2
    sampling: SamplingParams | None = None
    wire_dtype: str = "float32"
    drafter: str | None = None
    precision: Precision | None = None  # None: the fastest setting here
    model: str = "default"
    core_layout: str = "halves"
    draft_model: str | None = None


def run_speculation(bench: SpeculationBench = SpeculationBench(),
                    progress: Callable[[str], None] = lambda _: None) -> dict:
    """The benchmark end to end, both sides in the bench's precision; writes OUT/speculation.json and
    OUT/speculation.md."""
    modes = bench.modes if "sequential" in bench.modes else ("sequential", *bench.modes)
    bench = replace(bench, modes=modes, precision=bench.precision or fastest())
    cores = sides(bench.core_layout)
    set_compute_threads(cores.threads)
    client = SplitClient(bench.model, first=bench.first, last=bench.last, wire_dtype=bench.wire_dtype,
                         precision=bench.precision, drafter=bench.drafter, draft_model=bench.draft_model)
    bench = replace(bench, modes=_draftable(client, bench.modes, progress))
    prompts = [(p.category, p.text) for p in workload(bench.prompts_per_category)]
    settings = _settings(bench, client, cores)
    runs = _measure_over_link(bench, client, cores, prompts, progress)
    summary = summarize(runs, bench.modes)
    peer = _rpc_peer(bench, cores, progress)
    whole = _whole_model_peers(bench, cores, progress)
    diverged = divergences(client, prompts, runs) if not (bench.sampling and bench.sampling.do_sample) else []
    data = {"settings": settings, "summary": summary, "divergences": diverged, "llama_cpp_rpc": peer,
            "llama_cpp_whole": whole}
    folder = Path(bench.out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "speculation.json").write_text(json.dumps({**data, "runs": runs}))
    (folder / "speculation.md").write_text(report(data))
    return data


def _draftable(client: SplitClient, modes: tuple[str, ...], progress: Callable[[str], None]) -> tuple[str, ...]:
    """`modes` less those that need a drafter or a draft model, when the client has neither."""
    needs_drafter = [m for m in modes if m in ("drafter", "drafter-wide")]
    if client.client_model.drafter is None and client.client_model.draft_model is None and needs_drafter:
        progress(f"no drafter for this model: {', '.join(needs_drafter)} left out")
        return tuple(m for m in modes if m not in needs_drafter)
    return modes


def _settings(bench: SpeculationBench, client: SplitClient, cores: Sides) -> dict:
    """What the report says it measured."""
    assert bench.precision is not None
    return {
        "model": bench.model, "rtt_ms": bench.rtt_ms, "max_new_tokens": bench.max_new_tokens,
        "prompts_per_category": bench.prompts_per_category, "first": bench.first, "last": bench.last,
        "modes": list(bench.modes), "sampling": asdict(bench.sampling or SamplingParams()),
        "wire_dtype": bench.wire_dtype,
        "drafter": _drafting(client.client_model.drafter, client.client_model.draft_model, bench.drafter),
        "precision": bench.precision.name, "linear_kernels": cpu_kernels.linear_path(),
        "cores": {"layout": cores.layout, "threads": cores.threads,
                  "server": sorted(cores.server), "client": sorted(cores.client)},
    }


def _measure_over_link(
    bench: SpeculationBench, client: SplitClient, cores: Sides, prompts: Sequence[tuple[str, str]],
    progress: Callable[[str], None],
) -> list[dict]:
    """A server process on its cores behind the WAN proxy; the client, warmed up, measures every mode on its own."""
    assert bench.precision is not None
    serve = ("--model", bench.model, "--first", str(bench.first), "--last", str(bench.last),
             "--threads", str(cores.threads), *bench.precision.serve_args())
    with ServerProcess(*serve, cores=cores.server) as server, on_cores(cores.client):
        with ProxyThread("127.0.0.1", server.port, LinkProfile(rtt_ms=bench.rtt_ms)) as proxy:
            client.server = f"ws://127.0.0.1:{proxy.port}"
            with compute_threads_pinned():  # as the client commands do (the server pins its own); the proxy stays free
                client.generate(prompts[0][1], 4)  # warm up both sides (allocations, the first WebSocket)
                return measure(client, prompts, bench.max_new_tokens, bench.modes, progress, bench.sampling)


def _rpc_peer(bench: SpeculationBench, cores: Sides, progress: Callable[[str], None]) -> dict:
    """llama.cpp's RPC backend over the same emulated link and cores."""
    def rpc(gguf: Path) -> peers.PeerResult:
        return peers.rpc(gguf, cores.threads, bench.rtt_ms, bench.max_new_tokens, cores.server, cores.client)

    return peers.measured(bench.model, rpc, progress)


def _whole_model_peers(bench: SpeculationBench, cores: Sides, progress: Callable[[str], None]) -> dict[str, dict]:
    """llama.cpp with every layer in one local process, no link at all: what splitting must be weighed against.
    One thread runs pinned to the client's cores, more on both sides' cores; keyed by thread count."""
    found = {}
    for threads in WHOLE_MODEL_THREADS:
        on = cores.client if threads == 1 else cores.server | cores.client
        whole = functools.partial(peers.whole_model, threads=threads, tokens=bench.max_new_tokens, cores=on)
        found[str(threads)] = peers.measured(bench.model, whole, _with_threads(progress, threads))
    return found


def _with_threads(progress: Callable[[str], None], threads: int) -> Callable[[str], None]:
    """`progress` naming the thread count, which the peer's own line leaves out."""
    return lambda line: progress(f"{line} ({threads} thread{'s' * (threads > 1)})")


def report(data: dict) -> str:
    """The whole report of a run (`run_speculation`'s result, or its JSON without the runs)."""
    summary, diverged, peer = data["summary"], data["divergences"], data["llama_cpp_rpc"]
    text = markdown(summary, data["settings"])
    if diverged:
        text += "\nFirst differences from sequential (top-2 logit gap of the model at that prefix):\n\n"
        text += "| prompt | mode | at token | top-2 gap |\n| --- | --- | --- | --- |\n"
        text += "".join(f"| {d['prompt']} | {d['mode']} | {d['index']} | {d['gap']:.3g} |\n" for d in diverged)
    auto = summary["overall"].get("auto", {}).get("tokens_per_second", 0.0)
    if "tokens_per_second" in peer:
        text += ("\nllama.cpp RPC (every layer remote, nothing private; the same cores and threads) "
                 f"over the same link: {peer['tokens_per_second']:.2f} tok/s; "
                 f"auto is {auto / peer['tokens_per_second']:.2f}x that.\n")
    else:
        text += f"\nllama.cpp RPC: {peer['skipped']}\n"
    return text + _whole_model_lines(data.get("llama_cpp_whole", {}), auto)


def _whole_model_lines(whole: dict[str, dict], auto: float) -> str:
    """A line per thread count for llama.cpp's whole model run locally (results before it was measured have none)."""
    text = ""
    for threads, peer in whole.items():
        where = "pinned to the client's cores" if threads == "1" else "on both sides' cores"
        label = f"llama.cpp whole model, {threads} thread{'s' * (threads != '1')}"
        if "tokens_per_second" in peer:
            text += (f"\n{label} ({where}, every layer local, no link): {peer['tokens_per_second']:.2f} tok/s; "
                     f"auto is {auto / peer['tokens_per_second']:.2f}x that.\n")
        else:
            text += f"\n{label}: {peer['skipped']}\n"
    return text
