"""The adaptive budget: it reads the link, compute and acceptance from steps and picks the fastest budget."""

from __future__ import annotations

import pytest

from splitllm.client.client import SplitClient
from splitllm.decoding.sizing.auto_profile import CANDIDATE_BUDGETS, AutoProfile, BudgetYield
from splitllm.decoding.sizing.budget import NodeCost, SpecBudget
from splitllm.decoding.mode_names import Mode
from splitllm.decoding.speculation_config import SpeculationConfig
from splitllm.decoding.modes import DECODERS
from splitllm.decoding.sizing.policies import AdaptivePolicy, ValuePolicy, split_rows
from splitllm.decoding.speculative import SpeculativeDecoder
from splitllm.decoding.sizing.latency import (
    LOCAL,
    OVERHEAD,
    PER_BYTE,
    STEP_SIZE,
    COMPUTE,
    LatencyProfile,
    LinearFit,
    Link,
    StepShape,
)
from splitllm.testing.netem import LinkProfile, ProxyThread
from splitllm.stats import StepSpeculation, StepStats, StepTiming


def _linear(features: tuple[str, ...], coef: dict[str, float]) -> LinearFit:
    return LinearFit(features, tuple(coef.get(f, 0.0) for f in features))


# A CPU-like pair: the server's step costs 25 ms plus 2 ms a node; the client's LM head 4 ms a token.
PROFILE = LatencyProfile(
    local=_linear(LOCAL, {"1": 3.0, "nodes": 0.4, "single": -0.5, "accepted": 4.0, "windowed": 8.0}),
    server=_linear(COMPUTE, {"1": 25.0, "nodes": 2.0, "single": -2.0, "nodes*context": 0.0005}),
    overhead=_linear(OVERHEAD, {"1": 0.3, "bytes": 2e-6}),
    framing=_linear(PER_BYTE, {"1": 1.0, "bytes": 1e-5}),
    wire_up=_linear(STEP_SIZE, {"1": 100.0, "nodes": 1200.0}),
    wire_down=_linear(STEP_SIZE, {"1": 50.0, "nodes": 1152.0}),
    decode={"auto": _linear(STEP_SIZE, {"1": 0.5, "nodes": 0.05})},
)
YIELDS = [(1.0, 1.0), (3.0, 1.3), (12.0, 1.6), (24.0, 1.85), (40.0, 2.05)]  # (nodes, tokens) per step
AUTO = AutoProfile(PROFILE, [BudgetYield(b, n, a, 0.0, float(n == 1)) for b, (n, a) in zip(CANDIDATE_BUDGETS, YIELDS)])


def _step(profile: AutoProfile, c: BudgetYield, link: Link, history: list[StepStats], gain: float = 1.0,
          server_scale: float = 1.0, row_scale: float = 1.0) -> StepStats:
    """The next step as a world obeying the profile measures it; the first one carries a 40-token prompt.

    Tokens per step are fractional on average: each step accepts the whole tokens the running total
    has crossed, so a candidate yielding 1.3 a step really does over a generation.
    """
    n = c.nodes if history else 40.0
    context = history[-1].timing.context + history[-1].speculation.accepted if history else 0
    shape = BudgetYield(c.budget, n, 1 + gain * (c.accepted - 1), c.windowed, float(n == 1)).shape(context)
    credit = sum(getattr(s.timing, "_credit", 0.0) for s in history[-1:]) + shape.accepted
    p = profile.latency.predict(shape, link, "auto")
    fixed, rows = split_rows(profile.latency.server, shape.features())
    server = (fixed + rows * row_scale) * server_scale  # row_scale: a model whose rows cost more than profiled
    up, down = profile.latency.bytes(shape)
    t = StepTiming(
        nodes=round(n), first_ms=p.local / 2, last_ms=p.local / 2,
        serialize_ms=p.overhead, server_ms=server, decode_ms=p.decode,
        round_trip_ms=server + p.rtt + p.transfer + p.framing,
        bytes_up=round(up), bytes_down=round(down), context=context,
    )
    t._credit = credit - int(credit)  # type: ignore[attr-defined]
    t.total_ms = t.client_ms + t.round_trip_ms
    return StepStats(t, StepSpeculation(accepted=int(credit)))


def _candidate(profile: AutoProfile, budget: SpecBudget) -> BudgetYield:
    """The candidate of a budget; the offline budget (the first step's) may be none of them."""
    nodes = 1 + budget.max_nodes + budget.window_nodes
    return next((c for c in profile.candidates if c.budget == budget), BudgetYield(budget, nodes, 1.0))


def _generate(policy: AdaptivePolicy, link: Link, steps: int = 40, **world: float) -> list[BudgetYield]:
    """Drive the policy through one generation in the simulated world; the candidates it chose."""
    history: list[StepStats] = []
    chosen = []
    for _ in range(steps):
        budget = policy.choose(history)
        chosen.append(_candidate(policy.profile, budget))
        history.append(_step(policy.profile, chosen[-1], link, history, **world))
    return chosen


def _best(profile: AutoProfile, link: Link, context: float = 60, gain: float = 1.0) -> BudgetYield:
    return max(
        profile.candidates,
        key=lambda c: profile.latency.predict(c.shape(context, gain), link, "auto").tokens_per_second,
    )


@pytest.mark.parametrize("rtt", [0.0, 20.0, 80.0, 200.0])
def test_policy_picks_the_fastest_candidate_for_the_link(rtt: float) -> None:
    chosen = _generate(AdaptivePolicy(AUTO), Link(rtt))
    assert chosen[-1] == _best(AUTO, Link(rtt))


def test_policy_speculates_little_on_a_fast_link_and_a_lot_on_a_slow_one() -> None:
    nodes = {rtt: _generate(AdaptivePolicy(AUTO), Link(rtt))[-1].nodes for rtt in (0.0, 80.0, 200.0)}
    assert nodes[0.0] <= 3 and nodes[80.0] >= 12 and nodes[200.0] >= nodes[80.0]


def test_link_estimate_recovers_rtt_and_bandwidth() -> None:
    policy = AdaptivePolicy(AUTO)
    _generate(policy, Link(80.0, 20.0))
    link = policy.link
    assert link.rtt_ms == pytest.approx(80.0, rel=0.02)
    assert link.bandwidth_mbit == pytest.approx(20.0, rel=0.05)
    _generate(policy, Link(30.0))  # the next generation starts from this one and follows the change
    assert policy.link.rtt_ms == pytest.approx(30.0, rel=0.05)


def test_higher_acceptance_than_measured_moves_to_a_bigger_budget() -> None:
    link = Link(20.0)
    plain = _generate(AdaptivePolicy(AUTO), link)[-1]
    keen = _generate(AdaptivePolicy(AUTO), link, steps=60, gain=3.5)[-1]
    assert keen.nodes > plain.nodes
    assert keen == _best(AUTO, link, gain=3.5)


def test_a_slower_server_than_profiled_moves_to_a_smaller_budget() -> None:
    link = Link(80.0)
    plain = _generate(AdaptivePolicy(AUTO), link)[-1]
    slow = _generate(AdaptivePolicy(AUTO), link, server_scale=4.0)[-1]
    assert slow.nodes < plain.nodes


def test_rows_dearer_than_profiled_are_priced_apart_from_the_fixed_cost() -> None:
    """A model whose server rows cost 4x the profile's at the same one-row cost (the prefill shows it,
    trees confirm it): the policy learns both parts, and a tree's node cost follows the rows."""
    link = Link(80.0)
    plain, dear = AdaptivePolicy(AUTO), AdaptivePolicy(AUTO)
    _generate(plain, link)
    _generate(dear, link, row_scale=4.0)
    fixed, rows = dear._latest.server.scales
    assert fixed == pytest.approx(1.0, abs=0.15) and rows == pytest.approx(4.0, rel=0.2)
    cost, dear_cost = ValuePolicy(plain).cost(60), ValuePolicy(dear).cost(60)
    rows_at = lambda n: split_rows(PROFILE.server, StepShape.at(n, 60, 1.0).features())[1]  # noqa: E731
    assert dear_cost.node_ms - cost.node_ms == pytest.approx(3 * (rows_at(32) - rows_at(8)) / 24, rel=0.25)


def test_interleaved_conversations_keep_their_own_estimates() -> None:
    """Each conversation builds its decoder from `DECODERS`, so its policy's estimates are its own."""
    assert DECODERS["auto"]().policy is not DECODERS["auto"]().policy
    near, far = [], []
    policies = {id(near): AdaptivePolicy(AUTO), id(far): AdaptivePolicy(AUTO)}
    for _ in range(30):  # two conversations taking turns, as concurrent requests would
        for history, link in ((near, Link(0.0)), (far, Link(200.0))):
            budget = policies[id(history)].choose(history)
            c = _candidate(AUTO, budget)
            history.append(_step(AUTO, c, link, history))
    assert near[-1].timing.nodes <= 3 and far[-1].timing.nodes >= 12


def test_profile_json_round_trip_and_the_shipped_default(tmp_path) -> None:  # type: ignore[no-untyped-def]
    AUTO.save(tmp_path / "auto.json")
    assert AutoProfile.load(tmp_path / "auto.json").to_json() == AUTO.to_json()
    shipped = AutoProfile.load()
    assert [c.budget for c in shipped.candidates] == list(CANDIDATE_BUDGETS)
    assert "auto" in shipped.latency.decode
    assert all(c.accepted >= 1 and c.nodes >= 1 for c in shipped.candidates)


@pytest.mark.slow
def test_auto_over_a_wan_link_matches_plain_decoding_and_reads_the_rtt(server) -> None:  # type: ignore[no-untyped-def]
    """Real model, real sockets: adaptive budgets change speed, never the text; the RTT is read from steps."""
    target = server(None, 2, 2)
    client = SplitClient(None, server=target.url, first=2, last=2)
    prompt = "Write a Python function that returns the squares of a list of numbers."
    reference = client.generate(prompt, 24).ids
    policy = AdaptivePolicy()
    with ProxyThread("127.0.0.1", target.port, LinkProfile(rtt_ms=60)) as proxy:
        client.server = f"ws://127.0.0.1:{proxy.port}"
        gen = client.generate(prompt, 24, decode=SpeculativeDecoder(SpeculationConfig(Mode.AUTO, policy)))
    assert gen.ids == reference
    assert policy.link.rtt_ms >= 55  # the proxy's delay is a floor; the ceiling is the machine's business
    largest = max(1 + b.max_nodes + b.window_nodes for b in CANDIDATE_BUDGETS)
    assert all(s.timing.nodes <= largest for s in gen.steps[1:])  # which budget wins is the machine's business too


def test_an_in_process_generation_after_a_networked_one_keeps_the_offline_budget() -> None:
    """What a policy learned about a link carries over, but only steps that cross a network use it:
    an in-process middle (no round trip beyond its compute) always gets the same, offline budget."""
    policy = AdaptivePolicy(AUTO)
    assert _generate(policy, Link(200.0))[-1].budget != policy.offline
    history: list[StepStats] = []
    for _ in range(5):
        assert policy.choose(history) == policy.offline
        timing = StepTiming(nodes=9, server_ms=40.0, round_trip_ms=40.0, total_ms=60.0, context=50)
        history.append(StepStats(timing, StepSpeculation(accepted=2)))


def test_node_cost_keeps_nodes_while_they_raise_tokens_per_second() -> None:
    # 0.5 * 100 > 1 * 10: kept; 0.2 * 110 > 1.5 * 10: kept; 0.1 * 120 < 1.7 * 10: the rest would slow it down
    assert NodeCost(100.0, 10.0).worth([0.5, 0.2, 0.1, 0.05]) == 2
    assert NodeCost(100.0, 10.0).worth([0.05]) == 0 and NodeCost(100.0, 0.01).worth([0.5, 0.2]) == 2


def test_trees_sized_by_value_grow_with_the_link() -> None:
    """The node cost comes from the live estimates: the same scores buy more nodes over a slower link."""
    scores = [0.9, 0.7, 0.5, 0.35, 0.25, 0.15, 0.1, 0.06, 0.04, 0.02, 0.01]
    kept, costs = {}, {}
    for rtt in (0.0, 80.0, 200.0):
        adaptive = AdaptivePolicy(AUTO)
        _generate(adaptive, Link(rtt))
        policy = ValuePolicy(adaptive)
        costs[rtt] = policy.cost(60)
        kept[rtt] = costs[rtt].worth(scores)
    assert costs[200.0].step_ms - costs[0.0].step_ms == pytest.approx(200.0, rel=0.05)
    assert costs[0.0].node_ms == pytest.approx(costs[200.0].node_ms, rel=0.05)  # compute and bytes, not the RTT
    assert 0 < kept[0.0] < kept[80.0] <= kept[200.0]
    budget = policy.choose([])
    assert budget.cost is not None and budget.max_nodes >= kept[200.0]
