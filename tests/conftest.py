"""Shared fixtures: the default model, tiny random models saved as HF folders, the splits server tests
use, servers on loopback.

Tiny models are built from transformers configs with a fixed seed and a wide initializer so greedy
margins stay far above float32 rounding; their norms and biases are randomized too (HF initializes
them to ones and zeros, which would hide mistakes in how we load them). They have no tokenizer:
tests drive them with token ids; `tiny_chat` adds one, with a chat template, for the public API.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import threading
import time
from contextlib import ExitStack
from functools import cache
from pathlib import Path

import pytest
import torch
from protocol_client import greedy
from tiny_tokenizer import VOCAB as TINY_CHAT_VOCAB
from tiny_tokenizer import save_tiny_tokenizer
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedModel,
    Qwen2Config,
)

from splitllm.attestation.simulation import sim_init
from splitllm.client.client_model import ClientModel
from splitllm.client.pipeline import InProcessMiddle, SplitPipeline
from splitllm.client.remote import RemoteMiddle
from splitllm.drafting.drafter import Drafter, drafter_config
from splitllm.testing.launch import ServerThread
from splitllm.model.precision import Precision
from splitllm.model.stage import Stage
from splitllm.weights.conversions import StoredWeights
from splitllm.weights.sources import ModelFiles
from splitllm.server.app import MiddleServer
from splitllm.server.settings import ServerSettings


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--record-traces", action="store_true",
                     help="write this CPU kind's step traces (tests/test_step_traces.py) instead of checking them")


def pytest_configure() -> None:
    """One compute thread: client, server threads and transformers share two cores, and OpenMP's
    spinning barriers degrade many-fold when oversubscribed (transformers' greedy decoding of the
    default model ran 5x slower with two threads than with one on a busy two-core machine)."""
    torch.set_num_threads(1)


TINY_SPLIT = (1, 1)
"""(first, last): the split the server tests of tiny models use, one client layer on each side of the middle."""
DEFAULT_SPLIT = (2, 2)
"""(first, last): the split the server tests of the packaged models use, two client layers on each side."""
DEFAULT_MODEL_CASE = pytest.param("default", marks=pytest.mark.slow)
"""The packaged default model as one case of a test parametrized by model name: slow, as every test that needs it."""
CHAT_CASES = ("tiny-chat", DEFAULT_MODEL_CASE)
"""The models the public API runs end to end on: the tiny one with a tokenizer (`tiny_chat`), and the default."""

TINY_VOCAB = 512
_TINY_COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.2,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
TINY_CONFIGS = {
    "llama": LlamaConfig(**_TINY_COMMON, num_hidden_layers=4, tie_word_embeddings=False),
    "qwen2": Qwen2Config(**_TINY_COMMON, num_hidden_layers=4, tie_word_embeddings=True),
    # Heads of 64 (as the real models have) so 16-bit runs take the CPU attention kernel.
    "mistral": MistralConfig(**_TINY_COMMON, num_hidden_layers=6, head_dim=64, sliding_window=8,
                             tie_word_embeddings=False),
    # Every Gemma 3 feature: sliding (window 8) and full layers on each side of any split, their own rotary
    # (linear scaling on the full ones), q/k and sandwich norms, scaled embeddings, GELU, a query scale
    # other than the head size, and final logit soft-capping (the real 270M has none).
    "gemma3": Gemma3TextConfig(
        **_TINY_COMMON,
        num_hidden_layers=6,
        head_dim=64,  # the CPU kernels' smallest head, so 16-bit runs take the kernel stage
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 3,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0},
        },
        query_pre_attn_scalar=24,
        final_logit_softcapping=50.0,
    ),
}


# The public API's tiny model (`tiny_chat`): heads of 64, so its 16-bit runs take the CPU kernels and speculate.
# Its tokens are single characters, so its context is longer: a chat with tools runs to about 600 of them.
TINY_CHAT_CONFIG = LlamaConfig(**{**_TINY_COMMON, "vocab_size": TINY_CHAT_VOCAB, "max_position_embeddings": 2048},
                               num_hidden_layers=4, head_dim=64, tie_word_embeddings=False)


def _build_tiny(name: str, folder: Path) -> Path:
    torch.manual_seed(1234)
    config = TINY_CHAT_CONFIG if name == "chat" else TINY_CONFIGS[name]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.uniform_(0.5, 1.5)
            elif pname.endswith(".bias"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    return folder


class Distant(InProcessMiddle):
    """A simulation of a middle on another machine, `flight_ms` away: this in-process middle computes, then the
    client's core is free (the piece of client work runs, and may send a step ahead) until the reply would
    be back. `ahead` False: no step goes ahead. `wait` False: the reply comes as soon as that work is done,
    its round trip reported as `flight_ms` all the same, so the decoder's choices that follow the clock
    (preparing a tree until the reply is due, sending it ahead) come out alike however loaded the machine."""

    overlaps = True

    def __init__(self, stage: Stage, max_context: int, ahead: bool = True, flight_ms: float = 30.0,
                 wait: bool = True) -> None:
        super().__init__(stage, max_context)
        self.ahead, self.flight_ms, self.wait = ahead, flight_ms, wait

    @property
    def ahead_ready(self) -> bool:
        return self.ahead and super().ahead_ready

    def _run(self, compute, timing, while_waiting):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = compute()
        timing.server_ms += (time.perf_counter() - t0) * 1000
        self._in_step = True
        next(while_waiting or iter(()), None)
        self._in_step = False
        if self.wait:
            time.sleep(max(0.0, t0 + self.flight_ms / 1000 - time.perf_counter()))
        timing.round_trip_ms += max((time.perf_counter() - t0) * 1000, 0.0 if self.wait else self.flight_ms)
        return out


def random_drafter(files: ModelFiles, dtype: torch.dtype = torch.float32, seed: int = 0,
                   taps: tuple[int, ...] = ()) -> Drafter:
    """An untrained drafter over the whole vocabulary (fusing the outputs of layers `taps`): drafts are
    noise, which exactness must survive."""
    drafter = Drafter(drafter_config(files.config), range(files.config.vocab_size), dtype, taps)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            noise = torch.rand(p.shape, generator=g, dtype=p.dtype)
            p.copy_(noise + 0.5 if "norm" in name else (noise - 0.5) * 0.4)
    return drafter


def _folder(model: str | Path | None) -> Path:
    """One cache key per model however it is named (None, 'default', its folder)."""
    return ModelFiles(model).path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> HF folder of a tiny random model: llama (untied LM head), qwen2 (qkv bias), mistral (window 8),
    gemma3 (alternating sliding and full layers, and Gemma's norms, scales and activation)."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {name: _build_tiny(name, root / name) for name in TINY_CONFIGS}


@pytest.fixture(scope="session")
def tiny_chat(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama with a tiny tokenizer whose chat template takes tools (tests/tiny_tokenizer.py): the
    public API end to end in the fast tier."""
    folder = _build_tiny("chat", tmp_path_factory.mktemp("tiny-chat"))
    save_tiny_tokenizer(folder)
    return str(folder)


@pytest.fixture(scope="session")
def chat_split(tiny_chat: str) -> Callable[[str], tuple[str | None, int, int]]:
    """(model, first, last) of "tiny-chat" or a packaged model's name."""
    return lambda case: (tiny_chat, *TINY_SPLIT) if case == "tiny-chat" else (case, *DEFAULT_SPLIT)


@pytest.fixture(scope="session")
def tiny(tiny_models: dict[str, Path]) -> str:
    """The tiny Llama's folder as a string, as `MiddleServer` and `splitllm serve --model` take it."""
    return str(tiny_models["llama"])


def _vocab16(folder: Path, seed: int, layers: int) -> Path:
    cfg = LlamaConfig(
        vocab_size=16, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=layers, max_position_embeddings=64, initializer_range=0.3, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def vocab16_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with 16 tokens (max position 64), peaked enough that speculative candidates are
    accepted often and rejected often, even a random drafter's."""
    return _vocab16(tmp_path_factory.mktemp("vocab16"), seed=0, layers=3)


@pytest.fixture(scope="session")
def vocab16_draft_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another random 16-token Llama (two layers): a draft model for `vocab16_model` that is right only sometimes."""
    return _vocab16(tmp_path_factory.mktemp("vocab16-draft"), seed=1, layers=2)


@pytest.fixture(scope="session")
def vendor(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A simulated SEV-SNP vendor and guest, and the policy.json that trusts them (`splitllm attest sim-init`)."""
    folder = tmp_path_factory.mktemp("vendor")
    sim_init(folder)
    return folder


@pytest.fixture(scope="session")
def default_files() -> ModelFiles:
    return ModelFiles(None)


@pytest.fixture(scope="session")
def hf_model() -> Callable[[str | Path | None], PreTrainedModel]:
    """The unsplit transformers reference of a model folder (None = default), loaded once per session."""

    @cache
    def load(path: Path) -> PreTrainedModel:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    return lambda model: load(_folder(model))


@pytest.fixture(scope="session")
def load_client_model() -> Callable[..., ClientModel]:
    """ClientModel(files, first, last), built once per (model, split)."""

    @cache
    def load(path: Path, first: int, last: int) -> ClientModel:
        return ClientModel(ModelFiles(path), first, last)

    return lambda model, first, last: load(_folder(model), first, last)


@pytest.fixture(scope="session")
def middle_stage() -> Callable[..., Stage]:
    """The middle Stage of a (model, split) for in-process runs, built once."""

    @cache
    def load(path: Path, first: int, last: int) -> Stage:
        files = ModelFiles(path)
        return Stage.load(files, first, files.config.num_layers - last, torch.float32)

    return lambda model, first, last: load(_folder(model), first, last)


@pytest.fixture(scope="session")
def pipeline(load_client_model, middle_stage) -> Callable[..., SplitPipeline]:
    """A fresh in-process SplitPipeline (InProcessMiddle) over a (model, split): new caches every call."""

    def make(model: str | Path | None, first: int = 2, last: int = 1, max_context: int = 256) -> SplitPipeline:
        client_model = load_client_model(model, first, last)
        return SplitPipeline(client_model, InProcessMiddle(middle_stage(model, first, last), max_context), max_context)

    return make


@pytest.fixture(scope="session")
def server() -> Iterator[Callable[..., ServerThread]]:
    """server(model, first, last, **settings): a ServerThread on loopback, started once per arguments."""
    started: dict[tuple, ServerThread] = {}
    with ExitStack() as stack:

        def start(model: str | Path | None, first: int, last: int, **settings: object) -> ServerThread:
            key = (_folder(model), first, last, tuple(sorted(settings.items())))
            if key not in started:
                middle = MiddleServer(str(key[0]), ServerSettings(first=first, last=last, **settings))
                started[key] = stack.enter_context(ServerThread(middle))
            return started[key]

        yield start


@pytest.fixture(scope="session")
def split_greedy() -> Callable[..., list[int]]:
    """split_greedy(client_model, url, prompt, n, wire_dtype="float32"): greedy ids of the split model over a
    new session on the server at `url`, driven by token ids so no tokenizer is needed."""

    def run(client_model: ClientModel, url: str, prompt: list[int], new_tokens: int,
            wire_dtype: str = "float32") -> list[int]:
        middle = RemoteMiddle(url, client_model.files.fingerprint, client_model.middle_range, wire_dtype,
                              len(prompt) + new_tokens)
        return greedy(client_model, middle, prompt, new_tokens)

    return run


@pytest.fixture(scope="session")
def hf_greedy(hf_model) -> Callable[..., list[int]]:
    """New token ids of transformers' greedy generate on the unsplit model (stops at the config's EOS)."""

    def run(model: str | Path | None, prompt: list[int], max_new_tokens: int) -> list[int]:
        ref = hf_model(model)
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
        return out[0, len(prompt) :].tolist()

    return run


@pytest.fixture(scope="session")
def random_ids() -> Callable[..., list[int]]:
    """random_ids(n, seed, vocab=512): reproducible token ids for tiny-model prompts and trees."""

    def make(n: int, seed: int, vocab: int = TINY_VOCAB) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

    return make


@pytest.fixture
def tensor_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of every tensor read from a model's own files during the test, in order: through
    ModelFiles.read (conversions, lookups) or by an exact-mode load, which builds on the checkpoint itself."""
    names: list[str] = []
    read, stored = ModelFiles.read, StoredWeights.__init__

    def spy_read(self: ModelFiles, wanted, dtype):  # type: ignore[no-untyped-def]
        wanted = list(wanted)
        names.extend(wanted)
        return read(self, wanted, dtype)

    def spy_stored(self: StoredWeights, files: ModelFiles, precision: Precision,  # type: ignore[no-untyped-def]
                   wanted) -> None:
        wanted = list(wanted)
        if precision.exact:
            names.extend(wanted)
        stored(self, files, precision, wanted)

    monkeypatch.setattr(ModelFiles, "read", spy_read)
    monkeypatch.setattr(StoredWeights, "__init__", spy_stored)
    return names


@pytest.fixture
def stage_threads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, str]]:
    """(what, the stage's first layer, thread name) for every Stage load and forward during the test."""
    seen: list[tuple[str, int, str]] = []
    load, forward_many = Stage.load.__func__, Stage.forward_many  # type: ignore[attr-defined]

    def spy_load(cls, files, start, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(("load", start, threading.current_thread().name))
        return load(cls, files, start, *args, **kwargs)

    def spy_forward(self, steps):  # type: ignore[no-untyped-def]
        seen.append(("forward", self.start, threading.current_thread().name))
        return forward_many(self, steps)

    monkeypatch.setattr(Stage, "load", classmethod(spy_load))
    monkeypatch.setattr(Stage, "forward_many", spy_forward)
    return seen
