"""`splitllm bench sweep`: tokens per second against RTT for every decoding mode, measured and predicted.

A real server subprocess sits behind the WAN proxy; the client runs the shared workload through it
at each link, every mode interleaved prompt by prompt so a disturbance of the shared machine hits
them alike. The link's real RTT is measured with WebSocket pings through the proxy (its timer adds
a millisecond or two to the nominal delay). The latency model is then checked by leave-one-link-out
cross-validation: fitted on every other link, it predicts the held-out one.

Before the sweep, a calibration pass on prompts the sweep does not use (loopback, no proxy) measures
what each adaptive candidate yields per step and fits the profile `--decode auto` starts from.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TypeVar

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from websockets.sync.client import connect

from splitllm.lab.bench.quiet import OtherLoad, wait_quiet
from splitllm.lab.data.workload import CATEGORIES, Prompt, workload
from splitllm.client.client import SplitClient
from splitllm.decoding.sizing.auto_profile import CANDIDATE_BUDGETS, AutoProfile, BudgetYield
from splitllm.decoding.sizing.budget import LOOKAHEAD_BUDGET, LOOKUP_BUDGET, SpecBudget
from splitllm.decoding.mode_names import Mode
from splitllm.decoding.speculation_config import SpeculationConfig
from splitllm.decoding.sizing.policies import AdaptivePolicy, StaticPolicy
from splitllm.decoding.speculative import SpeculativeDecoder
from splitllm.decoding.sequential import decode_sequential
from splitllm.decoding.sizing.latency import (
    LatencyProfile,
    Link,
    StepRecord,
    StepShape,
    ideal_tokens_per_second,
    tokens_per_second,
)
from splitllm.testing.launch import ServerProcess
from splitllm.model.precision import Precision, fastest
from splitllm.testing.netem import LinkProfile, ProxyThread
from splitllm.stats import StepStats
from splitllm.threads import set_compute_threads

ADAPTIVE = "auto"
T = TypeVar("T")


@dataclass(frozen=True)
class Point:
    """A link to measure at: nominal RTT and an optional bandwidth cap each way."""

    rtt_ms: float
    bandwidth_mbit: float | None = None

    @property
    def label(self) -> str:
        bw = "" if self.bandwidth_mbit is None else f" @ {self.bandwidth_mbit:g} Mbit/s"
        return f"{self.rtt_ms:g} ms{bw}"


POINTS = (Point(0), Point(20), Point(40), Point(80), Point(120), Point(200), Point(80, 20.0))


def parse_points(text: str) -> list[Point]:
    """'0,20,80@20' -> links of 0 and 20 ms, and 80 ms capped at 20 Mbit/s."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        rtt, _, bw = item.partition("@")
        out.append(Point(float(rtt), float(bw) if bw else None))
    if not out:
        raise ValueError("no links given")
    return out


@dataclass(frozen=True)
class Config:
    """One way of decoding: `decoder` names its decode-time fit (configs of one decoder share it)."""

    label: str
    decoder: str
    budget: SpecBudget | None = None  # fixed budget of a speculative decoder; None for the adaptive one

    @property
    def adaptive(self) -> bool:
        return self.label == ADAPTIVE

    def make(self, profile: AutoProfile | None) -> Callable:
        """A fresh decoder (the adaptive one with a fresh policy, so each link starts from the profile)."""
        if self.decoder == "sequential":
            return decode_sequential
        policy = AdaptivePolicy(profile) if self.adaptive else StaticPolicy(self.budget)
        return SpeculativeDecoder(SpeculationConfig(Mode(self.decoder), policy))


def candidate_label(budget: SpecBudget) -> str:
    """auto/N, N the most nodes a step of this budget sends (root, tree and window)."""
    return f"auto/{1 + budget.max_nodes + budget.window_nodes}"


def fixed_configs() -> list[Config]:
    """Sequential, the fixed-budget modes, and every adaptive candidate as a fixed mode of its own."""
    configs = [
        Config("sequential", "sequential"),
        Config("lookahead", "lookahead", LOOKAHEAD_BUDGET),
        Config("lookup", "lookup", LOOKUP_BUDGET),
    ]
    configs += [Config(candidate_label(b), "auto", b) for b in CANDIDATE_BUDGETS if b.max_nodes or b.window]
    return configs


@dataclass
class Run:
    """Every generation of one config at one link: its decode steps (prefills apart)."""

    point: Point
    config: Config
    rtt_ms: float  # measured
    steps: list[StepStats] = field(default_factory=list)
    prefills: list[StepStats] = field(default_factory=list)
    other_cores: list[float] = field(default_factory=list)  # others' CPU during each generation

    @property
    def link(self) -> Link:
        return Link(self.rtt_ms, self.point.bandwidth_mbit)

    @property
    def tokens_per_second(self) -> float:
        return tokens_per_second(self.steps)

    @property
    def ideal_tokens_per_second(self) -> float:
        return ideal_tokens_per_second(self.steps, self.link)

    def records(self) -> list[StepRecord]:
        return [StepRecord(s, self.link, self.config.decoder) for s in self.steps]


def ping_times(url: str, pings: int) -> list[float]:
    """WebSocket ping round trips to `url` (ms): the link as the client sees it, proxy timer included."""
    with connect(url.rstrip("/") + "/ws", compression=None, open_timeout=30) as ws:
        times = []
        for _ in range(pings + 1):
            t0 = time.perf_counter()
            if not ws.ping().wait(30):
                raise TimeoutError("no pong within 30 s")
            times.append((time.perf_counter() - t0) * 1000)
    return times[1:]  # the first ping may pay for lazy set-up on either side


@dataclass(frozen=True)
class Quiet:
    """When a generation counts: others on the shared machine used under `max_cores` while it ran.

    Each generation waits for such a moment; one disturbed anyway is queued again (at most `retries`
    times). After `deadline_s`, what is left runs whatever the load (the report shows the load).
    `max_cores=0` measures at once, always.
    """

    max_cores: float = 0.3
    deadline_s: float = 3600.0
    retries: int = 3


class _Bench:
    """The client of a sweep, its server's process, and the rule for disturbed generations."""

    def __init__(self, client: SplitClient, server_pid: int, quiet: Quiet) -> None:
        self.client, self.quiet = client, quiet
        self.pids = [os.getpid(), server_pid]
        self.deadline = time.monotonic() + quiet.deadline_s

    @property
    def gating(self) -> bool:
        return self.quiet.max_cores > 0 and time.monotonic() < self.deadline

    def disturbed(self, others: float) -> bool:
        return self.gating and others >= self.quiet.max_cores

    def wait(self) -> None:
        if self.gating:
            wait_quiet(self.pids, self.quiet.max_cores, timeout_s=max(self.deadline - time.monotonic(), 0.0))

    def generate(self, url: str, prompt: str, max_new_tokens: int, decoder: Callable) -> tuple[list[StepStats], float]:
        """Steps of one generation (prefill first) and the cores others used meanwhile."""
        self.client.server = url
        gc.collect()
        with OtherLoad(self.pids) as load:
            steps = self.client.generate(prompt, max_new_tokens, decode=decoder).steps
        return steps, load.cores

    def undisturbed(
        self, tasks: Iterable[T], attempt: Callable[[T], tuple[list[StepStats], float]],
        later: Callable[[T, float], None] = lambda *_: None,
    ) -> Iterator[tuple[T, list[StepStats], float]]:
        """Each task with the steps of its `attempt` that counts, and the cores others used meanwhile: a
        disturbed one goes to the back of the queue (`later` is told), at most `quiet.retries` times."""
        queue = deque(tasks)
        tries: Counter = Counter()
        while queue:
            task = queue.popleft()
            steps, others = attempt(task)
            if self.disturbed(others) and tries[task] < self.quiet.retries:
                tries[task] += 1
                queue.append(task)
                later(task, others)
                continue
            yield task, steps, others


def calibrate(
    bench: _Bench, url: str, prompts: Sequence[Prompt], max_new_tokens: int, progress: Callable[[str], None]
) -> AutoProfile:
    """Run every candidate budget over the prompts at `url`; fit the auto profile from their steps."""
    rtt = statistics.median(ping_times(url, 15))
    records: list[StepRecord] = []
    yields: dict[SpecBudget, list[StepStats]] = {b: [] for b in CANDIDATE_BUDGETS}

    def attempt(task: tuple[Prompt, SpecBudget]) -> tuple[list[StepStats], float]:
        prompt, budget = task
        bench.wait()
        decoder = SpeculativeDecoder(SpeculationConfig(Mode.AUTO, StaticPolicy(budget)))
        return bench.generate(url, prompt.text, max_new_tokens, decoder)

    tasks = [(prompt, budget) for prompt in prompts for budget in CANDIDATE_BUDGETS]
    for (prompt, budget), steps, others in bench.undisturbed(tasks, attempt):
        yields[budget] += steps[1:]
        records += [StepRecord(s, Link(rtt), "auto") for s in steps[1:]]
        progress(f"calibration {candidate_label(budget)} ({prompt.category}): others {others:.2f} cores")
    candidates = []
    for budget, steps in yields.items():
        shape = StepShape.of(steps)
        candidates.append(BudgetYield(budget, shape.nodes, shape.accepted, shape.windowed, shape.single))
    return AutoProfile(LatencyProfile.fit(records), candidates)


def run_sweep(
    points: Sequence[Point] = POINTS,
    per_category: int = 1,
    max_new_tokens: int = 64,
    profile: AutoProfile | None = None,
    log_path: str | None = None,
    quiet: Quiet = Quiet(),
    precision: Precision | None = None,
) -> tuple[list[Run], AutoProfile]:
    """Measure every config at every point; calibrate the adaptive profile first unless one is given.

    Every link has its own proxy for the whole sweep, so generations can run in any order: they are
    interleaved (prompt by prompt, link by link, mode by mode), and a disturbed one goes to the back
    of the queue. Each link's RTT is the median of pings taken in quiet moments before its first runs.
    Client and server compute in `precision` (the fastest setting unless told otherwise).
    """
    set_compute_threads(1)
    precision = precision or fastest()
    prompts = workload(per_category)
    held_out = [Prompt(c, workload(8, (c,))[-1].text) for c in CATEGORIES]  # never in a measured run
    configs = [*fixed_configs(), Config(ADAPTIVE, "auto")]
    client = SplitClient(None, first=2, last=2, precision=precision)
    total = len(prompts) * len(points) * len(configs) + (0 if profile else len(held_out) * len(CANDIDATE_BUDGETS))
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with ExitStack() as stack:
        server = stack.enter_context(ServerProcess("--first", "2", "--last", "2", "--threads", "1",
                                                   *precision.serve_args(), log_path=log_path))
        bar = _Bar(stack.enter_context(Progress(*columns)), total)
        assert server.proc is not None
        bench = _Bench(client, server.proc.pid, quiet)
        bench.generate(server.url, prompts[0].text, 16, decode_sequential)  # warm up both sides
        if profile is None:
            bar.describe("calibrating auto")
            profile = calibrate(bench, server.url, held_out, max_new_tokens, bar.done)
        urls: dict[Point, str] = {}
        for point in points:
            link = LinkProfile(rtt_ms=point.rtt_ms, bandwidth_mbit=point.bandwidth_mbit)
            urls[point] = f"ws://127.0.0.1:{stack.enter_context(ProxyThread('127.0.0.1', server.port, link)).port}"
        runs = _measure(bench, prompts, urls, configs, profile, max_new_tokens, bar)
    return runs, profile


class _Bar:
    """The sweep's progress bar: what runs now, and a line per generation."""

    def __init__(self, progress: Progress, total: int) -> None:
        self.progress, self.task = progress, progress.add_task("warming up", total=total)

    def describe(self, text: str) -> None:
        self.progress.update(self.task, description=text)

    def note(self, line: str) -> None:
        self.progress.console.print(line)

    def done(self, line: str) -> None:
        """A generation that counts."""
        self.note(line)
        self.progress.advance(self.task)


def _measure(
    bench: _Bench, prompts: Sequence[Prompt], urls: dict[Point, str], configs: Sequence[Config], profile: AutoProfile,
    max_new_tokens: int, bar: _Bar,
) -> list[Run]:
    """Every prompt at every link (its proxy's URL) with every config, interleaved; each link's RTT from
    pings taken before its first runs."""
    runs = {(p, c.label): Run(p, c, 0.0) for p in urls for c in configs}
    decoders = {(p, c.label): c.make(profile) for p in urls for c in configs}  # a policy per link
    pings: dict[Point, list[float]] = {p: [] for p in urls}

    def attempt(task: tuple[Prompt, Point, Config]) -> tuple[list[StepStats], float]:
        prompt, point, config = task
        bar.describe(f"{point.label}: {config.label} ({prompt.category})")
        bench.wait()
        if len(pings[point]) < 20:
            pings[point] += ping_times(urls[point], 5)
        return bench.generate(urls[point], prompt.text, max_new_tokens, decoders[point, config.label])

    def later(task: tuple[Prompt, Point, Config], others: float) -> None:
        prompt, point, config = task
        bar.note(f"{point.label} {config.label} ({prompt.category}): others used {others:.2f} cores, later")

    tasks = [(prompt, point, config) for prompt in prompts for point in urls for config in configs]
    for (prompt, point, config), steps, others in bench.undisturbed(tasks, attempt, later):
        run = runs[point, config.label]
        run.prefills.append(steps[0])
        run.steps += steps[1:]
        run.other_cores.append(others)
        bar.done(f"{point.label} {config.label} ({prompt.category}): {tokens_per_second(steps[1:]):.2f} tok/s, "
                 f"others {others:.2f} cores")
    for run in runs.values():
        run.rtt_ms = statistics.median(pings[run.point])
    return list(runs.values())


def records(runs: Iterable[Run]) -> list[StepRecord]:
    return [r for run in runs for r in run.records()]


def shapes(runs: Iterable[Run]) -> dict[str, StepShape]:
    """Each fixed config's mean decode step over its runs: its measured tokens-per-step point."""
    steps: dict[str, list[StepStats]] = {}
    for r in runs:
        if not r.config.adaptive:
            steps.setdefault(r.config.label, []).extend(r.steps)
    return {label: StepShape.of(s) for label, s in steps.items()}


def predicted_speed(config: Config, link: Link, shapes: dict[str, StepShape], profile: LatencyProfile) -> float:
    """Predicted tok/s of a config on a link, from measured shapes and a fitted profile.

    A fixed config's tokens and nodes per step do not depend on the link, so its own shape serves;
    the adaptive config is the best of its candidates (plain decoding among them) under the model,
    the choice its policy makes; it shares the candidates' decoder and so their decode-time fit.
    """
    if not config.adaptive:
        return profile.predict(shapes[config.label], link, config.decoder).tokens_per_second
    return max(
        profile.predict(shape, link, config.decoder).tokens_per_second
        for label, shape in shapes.items()
        if label.startswith("auto/") or label == "sequential"
    )


def predict(runs: Sequence[Run], train: Sequence[Run], profile: LatencyProfile) -> dict[int, float]:
    """Predicted tok/s of each run (by index), from what `train` measured."""
    known = shapes(train)
    return {i: predicted_speed(run.config, run.link, known, profile) for i, run in enumerate(runs)}


def cross_validate(runs: Sequence[Run]) -> dict[int, float]:
    """Leave one link out: fit on the others' steps, predict the held-out link's runs."""
    out: dict[int, float] = {}
    for point in {r.point for r in runs}:
        train = [r for r in runs if r.point != point]
        profile = LatencyProfile.fit(records(train))
        held = [i for i, r in enumerate(runs) if r.point == point]
        predicted = predict([runs[i] for i in held], train, profile)
        out.update({held[j]: v for j, v in predicted.items()})
    return out
