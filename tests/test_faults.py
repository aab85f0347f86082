"""Faults without loss, over real loopback sockets: connections cut at random moments (through the
WAN emulator), servers restarted or killed mid-generation, sessions expiring, fail-over to another
server. Every interrupted run must produce exactly the tokens of an uninterrupted one. Plus steps
that fail mid-forward, which must leave the session's cache exactly as it was."""

from __future__ import annotations

import logging
import random
import threading
import time

import pytest
import torch
from conftest import TINY_SPLIT
from protocol_client import RawClient, greedy

from splitllm.client.client_model import ClientModel
from splitllm.client.connection import ConnectionOptions, ServerUnreachable
from splitllm.client.pipeline import InProcessMiddle, SplitPipeline
from splitllm.client.remote import RemoteMiddle
from splitllm.client.client import SplitClient
from splitllm.testing.launch import ServerProcess, ServerThread
from splitllm.weights.sources import ModelFiles
from splitllm.testing.netem import LinkProfile, ProxyThread
from splitllm.server.app import MiddleServer
from splitllm.server.settings import ServerSettings
from splitllm.decoding.sequential import decode_sequential
from splitllm.decoding.sizing.budget import SpecBudget
from splitllm.decoding.sizing.policies import StaticPolicy
from splitllm.decoding.mode_names import Mode
from splitllm.decoding.speculation_config import SpeculationConfig
from splitllm.decoding.speculative import SpeculativeDecoder
from splitllm.drafting.draft_model import DraftModel
from splitllm.model.stage import Stage, Step
from splitllm.model.visibility import Visibility
from splitllm.protocol.messages import ErrorMessage, ResultMessage

FIRST, LAST = TINY_SPLIT
NEW = 40


@pytest.fixture(scope="module")
def solo(tiny, server, load_client_model, random_ids):  # type: ignore[no-untyped-def]
    """(prompt, its greedy ids through an undisturbed server)."""
    prompt = random_ids(12, 7)
    return prompt, greedy(load_client_model(tiny, FIRST, LAST), _middle(server(tiny, FIRST, LAST).url, tiny), prompt,
                          NEW)


def _middle(url: str, model: str, **options: object) -> RemoteMiddle:
    files = ModelFiles(model)
    layers = (FIRST, files.config.num_layers - LAST)
    return RemoteMiddle(url, files.fingerprint, layers, "float16", 64, ConnectionOptions(**options))  # type: ignore[arg-type]


class _Chaos:
    """Resets every proxied connection at random moments (mid-step included) until stopped."""

    def __init__(self, proxy: ProxyThread, seed: int, gap_s: tuple[float, float]) -> None:
        self.proxy, self.rng, self.gap_s = proxy, random.Random(seed), gap_s
        self.drops = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.rng.uniform(*self.gap_s)):
            self.proxy.drop_connections()
            self.drops += 1

    def __enter__(self) -> _Chaos:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_connections_cut_at_random_moments_lose_nothing(tiny, server, load_client_model,  # type: ignore[no-untyped-def]
                                                        solo) -> None:
    prompt, expected = solo
    target = server(tiny, FIRST, LAST)
    with ProxyThread("127.0.0.1", target.port, LinkProfile(rtt_ms=20)) as proxy:
        middle = _middle(f"ws://127.0.0.1:{proxy.port}", tiny)
        rng = random.Random(3)
        cut_at = set(rng.sample(range(1, NEW), 6))  # also between steps, at random steps

        def between_steps(count: int) -> None:
            if count in cut_at:
                proxy.drop_connections()

        with _Chaos(proxy, seed=5, gap_s=(0.05, 0.25)) as chaos:
            got = greedy(load_client_model(tiny, FIRST, LAST), middle, prompt, NEW, between_steps)
    assert got == expected
    assert middle.reconnects >= len(cut_at) and chaos.drops > 0


def test_steps_sent_ahead_survive_connections_cut_at_random_moments(vocab16_model,  # type: ignore[no-untyped-def]
                                                                    server) -> None:
    """With a second step on the wire, a cut can lose the step ahead, its reply, or one dropped and not
    yet read: each is sent again or replayed, and the output is still sequential's."""
    files = ModelFiles(str(vocab16_model))
    client_model = ClientModel(files, 1, 1, torch.float64)
    client_model.draft_model = DraftModel(files, torch.float64)  # the model itself drafts: steps taken and dropped
    stage = Stage.load(files, 1, 2, torch.float64)
    prompt = torch.randint(0, 16, (8,), generator=torch.Generator().manual_seed(4)).tolist()
    local = SplitPipeline(client_model, InProcessMiddle(stage, 128), 128)
    expected = [t for o in decode_sequential(local, prompt, 48, frozenset()) for t in o.tokens]
    decoder = SpeculativeDecoder(SpeculationConfig(Mode.DRAFTER, drafter_policy=StaticPolicy(SpecBudget(12, depth=3))))
    target = server(vocab16_model, 1, 1, dtype=torch.float64)
    with ProxyThread("127.0.0.1", target.port, LinkProfile(rtt_ms=20)) as proxy:
        middle = RemoteMiddle(f"ws://127.0.0.1:{proxy.port}", files.fingerprint, client_model.middle_range, "float32",
                              128)
        with _Chaos(proxy, seed=7, gap_s=(0.05, 0.25)):
            outs = list(decoder(SplitPipeline(client_model, middle, 128), prompt, 48, frozenset()))
    assert [t for o in outs for t in o.tokens] == expected
    assert middle.reconnects > 0 and sum(o.stats.speculation.sent_ahead for o in outs) > 0


def test_every_connection_cut_after_a_byte_budget(tiny, server, load_client_model,  # type: ignore[no-untyped-def]
                                                  solo) -> None:
    prompt, expected = solo
    target = server(tiny, FIRST, LAST)
    client_model = load_client_model(tiny, FIRST, LAST)
    # The whole run sends ~11 kB; each connection dies after 8 kB, and the replay of the longest
    # context (~7 kB) plus one step still fits.
    with ProxyThread("127.0.0.1", target.port, LinkProfile(fault_after_bytes=8_000)) as proxy:
        middle = _middle(f"ws://127.0.0.1:{proxy.port}", tiny)
        assert greedy(client_model, middle, prompt, NEW) == expected
        assert middle.reconnects == 2
    # With 5 kB, the replay alone soon exceeds the budget: no step gets through, and the deadline ends it.
    with ProxyThread("127.0.0.1", target.port, LinkProfile(fault_after_bytes=5_000)) as proxy:
        with pytest.raises(ServerUnreachable, match="within 1 s"):
            greedy(client_model, _middle(f"ws://127.0.0.1:{proxy.port}", tiny, deadline_s=1.0), prompt, NEW)


def test_server_thread_restarted_on_the_same_port(tiny, load_client_model,  # type: ignore[no-untyped-def]
                                                  solo) -> None:
    prompt, expected = solo
    first = ServerThread(MiddleServer(tiny, ServerSettings(first=FIRST, last=LAST))).__enter__()
    restarted: list[ServerThread] = []

    def restart(count: int) -> None:
        if count == 15:
            first.__exit__(None, None, None)  # sessions gone; the port is closed for a while
            timer = threading.Timer(0.5, lambda: restarted.append(
                ServerThread(MiddleServer(tiny, ServerSettings(first=FIRST, last=LAST)), port=first.port).__enter__()))
            timer.start()

    middle = _middle(first.url, tiny)
    try:
        got = greedy(load_client_model(tiny, FIRST, LAST), middle, prompt, NEW, restart)
    finally:
        for thread in restarted:
            thread.__exit__(None, None, None)
    assert got == expected and middle.reconnects == 1


@pytest.mark.slow  # a server process started twice
def test_server_process_killed_and_restarted(tiny, load_client_model, solo,  # type: ignore[no-untyped-def]
                                             tmp_path) -> None:
    prompt, expected = solo
    args = ("--model", tiny, "--first", str(FIRST), "--last", str(LAST), "--threads", "1")
    processes = [ServerProcess(*args, log_path=str(tmp_path / "server.log")).__enter__()]

    def kill_and_restart(count: int) -> None:
        if count == 10:
            processes[0].proc.kill()  # no goodbye: the connection just breaks
            processes[0].proc.wait()
            threading.Thread(
                target=lambda: processes.append(ServerProcess(*args, port=processes[0].port).__enter__()), daemon=True
            ).start()

    try:
        middle = _middle(processes[0].url, tiny, deadline_s=120.0)
        got = greedy(load_client_model(tiny, FIRST, LAST), middle, prompt, NEW, kill_and_restart)
    finally:
        for p in processes:
            p.__exit__(None, None, None)
    assert got == expected and middle.reconnects == 1


def test_expired_session_is_rebuilt_from_the_record(tiny, load_client_model,  # type: ignore[no-untyped-def]
                                                    solo) -> None:
    prompt, expected = solo
    with ServerThread(MiddleServer(tiny, ServerSettings(first=FIRST, last=LAST, session_ttl_s=0.3))) as thread:

        def linger(count: int) -> None:
            if count in (5, 25):
                time.sleep(1.0)  # longer than the session's idle TTL

        middle = _middle(thread.url, tiny)
        assert greedy(load_client_model(tiny, FIRST, LAST), middle, prompt, NEW, linger) == expected
    assert middle.reconnects == 2


def test_fails_over_to_the_next_server(tiny, load_client_model, solo) -> None:  # type: ignore[no-untyped-def]
    prompt, expected = solo
    primary = ServerThread(MiddleServer(tiny, ServerSettings(first=FIRST, last=LAST))).__enter__()
    with ServerThread(MiddleServer(tiny, ServerSettings(first=FIRST, last=LAST))) as backup:

        def stop_primary(count: int) -> None:
            if count == 20:
                primary.__exit__(None, None, None)

        middle = _middle(primary.url, tiny, fallbacks=(backup.url,))
        got = greedy(load_client_model(tiny, FIRST, LAST), middle, prompt, NEW, stop_primary)
        assert got == expected and middle.url.startswith(backup.url)
        assert backup.server.metrics.total("splitllm_sessions_opened_total") == 1


def test_unreachable_server_fails_after_the_deadline_keeping_the_tokens(  # type: ignore[no-untyped-def]
    tiny, load_client_model, solo, caplog
) -> None:
    prompt, expected = solo
    caplog.set_level(logging.WARNING, "splitllm.client")
    ids: list[int] = []
    with ServerThread(MiddleServer(tiny, ServerSettings(first=FIRST, last=LAST))) as thread:
        middle = _middle(thread.url, tiny, deadline_s=1.0)

        def vanish(count: int) -> None:
            ids.append(expected[count - 1])
            if count == 8:
                thread.__exit__(None, None, None)

        t0 = time.monotonic()
        with pytest.raises(ServerUnreachable, match="within 1 s"):
            greedy(load_client_model(tiny, FIRST, LAST), middle, prompt, NEW, vanish)
        assert time.monotonic() - t0 < 60
    assert ids == expected[:8]
    waits = [r.getMessage() for r in caplog.records if r.getMessage().startswith("no splitllm server answered")]
    assert len(waits) == 1 and thread.url in waits[0] and "--reconnect-deadline-s" in waits[0]  # the wait is said, once


# --- the default model ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_client() -> SplitClient:
    return SplitClient(None, None, 2, 2, max_context=256)


@pytest.mark.slow
def test_default_model_decodes_through_cut_connections(default_client, server) -> None:  # type: ignore[no-untyped-def]
    target = server(None, 2, 2)
    client = default_client
    prompt = "List three fruits."
    client.server, client.connection = target.url, ConnectionOptions(deadline_s=30.0)
    expected = client.generate(prompt, 24, "sequential").ids
    with ProxyThread("127.0.0.1", target.port, LinkProfile(rtt_ms=20)) as proxy:
        client.server = f"ws://127.0.0.1:{proxy.port}"
        with _Chaos(proxy, seed=11, gap_s=(0.5, 1.0)) as chaos:  # small steps: each fits between two cuts
            got = client.generate(prompt, 24, "sequential").ids
    assert got == expected and chaos.drops > 0


@pytest.mark.slow
def test_default_model_generation_keeps_its_tokens_when_the_server_is_gone(  # type: ignore[no-untyped-def]
    default_client, server
) -> None:
    target = server(None, 2, 2)
    client = default_client
    prompt = "Name a color."
    client.server, client.connection = target.url, ConnectionOptions(deadline_s=1.0)
    expected = client.generate(prompt, 24).ids
    metrics = target.server.metrics
    with ProxyThread("127.0.0.1", target.port, LinkProfile(rtt_ms=10)) as proxy:
        client.server = f"ws://127.0.0.1:{proxy.port}"
        start = metrics.total("splitllm_steps_total")

        def cut_after_six_steps() -> None:
            while metrics.total("splitllm_steps_total") < start + 6:
                time.sleep(0.002)
            proxy.close()  # the link is gone for good

        threading.Thread(target=cut_after_six_steps, daemon=True).start()
        with pytest.raises(ServerUnreachable) as info:
            client.generate(prompt, 24)
    partial = info.value.generation.ids
    assert 5 <= len(partial) < 24 and partial == expected[: len(partial)]


# --- transactional steps ----------------------------------------------------------------------------------


def _tree_steps(d: int) -> list[tuple[torch.Tensor, list[int], Visibility, list[int]]]:
    """A prefill, a 4-node tree, then a step keeping a non-prefix path of it (so entries move)."""
    g = torch.Generator().manual_seed(0)
    tree = Visibility.from_parents([-1, 0, -1, 2])
    return [
        (torch.randn(6, d, generator=g), list(range(6)), Visibility.chain(6), []),
        (torch.randn(4, d, generator=g), [6, 7, 6, 7], tree, list(range(6))),
        (torch.randn(2, d, generator=g), [8, 9], Visibility.chain(2), [2, 3]),
        (torch.randn(1, d, generator=g), [10], Visibility.chain(1), [0, 1]),
    ]


def test_a_step_failing_mid_forward_leaves_the_cache_as_it_was(tiny,  # type: ignore[no-untyped-def]
                                                               monkeypatch) -> None:
    files = ModelFiles(tiny)
    layers = (FIRST, files.config.num_layers - LAST)
    server = MiddleServer(tiny, ServerSettings(first=FIRST, last=LAST))
    steps = _tree_steps(files.config.hidden_size)
    last = server.stage.layers[-1]
    original = last.forward
    faults = {"left": 0}

    def fail_after_writing(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = original(*args, **kwargs)  # every layer has written its K/V and `keep` has compacted
        if faults["left"]:
            faults["left"] -= 1
            raise RuntimeError("injected fault")
        return out

    monkeypatch.setattr(last, "forward", fail_after_writing)
    with ServerThread(server) as thread, RawClient(thread.url) as clean, RawClient(thread.url) as faulty:
        sessions = [c.open(files, layers).session for c in (clean, faulty)]  # type: ignore[union-attr]
        for hidden, positions, vis, keep in steps:
            want = clean.step(sessions[0], hidden, positions, keep, vis)
            faults["left"] = 1
            refused = faulty.step(sessions[1], hidden, positions, keep, vis)
            assert isinstance(refused, ErrorMessage) and (refused.code, refused.retryable) == ("internal", True)  # ours
            got = faulty.step(sessions[1], hidden, positions, keep, vis)  # the same step again
            assert isinstance(got, ResultMessage) and isinstance(want, ResultMessage)
            assert torch.equal(got.hidden, want.hidden)


def test_checkpoint_restores_exactly_and_copies_only_what_can_move(tiny) -> None:  # type: ignore[no-untyped-def]
    files = ModelFiles(tiny)
    server = MiddleServer(tiny, ServerSettings(first=FIRST, last=LAST))
    stage, cache = server.stage, server.stage.new_cache(32)
    for hidden, positions, vis, keep in _tree_steps(files.config.hidden_size)[:2]:
        stage(cache, Step(hidden, torch.tensor(positions), vis, keep))
    assert (cache.length, cache.pending) == (6, 4)
    filled = cache.length + cache.pending  # slots past these were never written: their bytes mean nothing

    def written() -> tuple[torch.Tensor, ...]:
        return cache.k[..., :filled, :].clone(), cache.v[..., :filled, :].clone(), cache.positions[:filled].clone()

    before = written()
    restore = cache.checkpoint([2, 3])
    hidden, positions, vis, keep = _tree_steps(files.config.hidden_size)[2]
    stage(cache, Step(hidden, torch.tensor(positions), vis, keep))  # moved entries 2, 3 and wrote 2 new ones
    assert not torch.equal(written()[0], before[0])
    restore()
    assert (cache.length, cache.pending) == (6, 4)
    assert all(torch.equal(a, b) for a, b in zip(written(), before))
