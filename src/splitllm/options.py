"""Every option of every `splitllm` command, declared once, as llama.cpp declares its arguments in one table.

An `Option` says its name (the flag is `--name` with `-` for `_` unless `flags` says otherwise), type,
default (and where a command's differs), help, unit, bounds, the commands that take it and the record
(`group`) a command may take it in. From this table come each command's typer options
(`commands.wiring.command`), the defaults of the records the options fill (`Split`,
`server.settings.ServerSettings`, `commands.client_commands.ClientSettings`), the environment variables
and docs/cli.md's option lists (`markdown`).

An option has one environment variable, `SPLITLLM_<OPTION>`, as llama.cpp's server reads `LLAMA_ARG_*`; every
runtime command that takes the option reads it, so one `SPLITLLM_FIRST` splits a server and its clients alike.
The lab's commands read none: a result records the command line that made it, and that line must reproduce it.
A name means one thing everywhere; a lab command that sweeps an option takes several of its values
(`--first 1,2,4` in `privacy audit`). A command never takes two options of one name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, Optional, get_args, get_origin

from splitllm.decoding.mode_names import DEFAULT_DECODE, Mode
from splitllm.decoding.proposers.suffix import MAX_TOKENS as SUFFIX_TOKENS
from splitllm.protocol.wire_dtypes import WIRE_DTYPE_NAMES
from splitllm.weights.packaged import DEFAULT_MODEL, PACKAGED_MODELS

ENV_PREFIX = "SPLITLLM"
REQUIRED: Any = ...  # the default of an option every run must give
# What each setting costs against float32 (perplexity, `splitllm bench quality`) is in docs/precision.md;
# the help strings point there rather than quote figures that go stale.
COSTS = "each setting's cost against float32: docs/precision.md"
RECIPE = " (default: the model's recipe, docs/drafting.md)"

# The commands, by the words that run them.
SERVE, GENERATE, CHAT, CLIENT_API = "serve", "generate", "chat", "client-api"
DEMO, NETEM, ATTEST_SIM_INIT, ATTEST_WEIGHTS = "demo", "netem", "attest sim-init", "attest weights"
BENCH_SPEED, BENCH_QUALITY = "bench speed", "bench quality"
BENCH_STREAMING, BENCH_SWEEP = "bench streaming", "bench sweep"
BENCH_SPECULATION, BENCH_CONFIDENTIAL = "bench speculation", "bench confidential"
BENCH_CONVERSATION, BENCH_STRUCTURED = "bench conversation", "bench structured"
BENCH_EXACTNESS, BENCH_DEFAULTS, BENCH_LOAD = "bench exactness", "bench defaults", "bench load"
BENCH_KERNELS, BENCH_SUFFIX = "bench kernels", "bench suffix"
PRIVACY_AUDIT, PRIVACY_PRIVATE_FIRST_STAGE = "privacy audit", "privacy private-first-stage"
DRAFTER_TRAIN, DRAFTER_COMPARE = "drafter train", "drafter compare"
CLIENTS = (GENERATE, CHAT, CLIENT_API)
RUNTIME = (SERVE, *CLIENTS, ATTEST_SIM_INIT, ATTEST_WEIGHTS)  # the commands that read environment variables
LINKED_BENCHES = (BENCH_SPECULATION, BENCH_CONFIDENTIAL, BENCH_CONVERSATION, BENCH_STRUCTURED, BENCH_SUFFIX)
REPORTING = (
    BENCH_SPEED, BENCH_QUALITY, BENCH_STREAMING, BENCH_SWEEP, *LINKED_BENCHES, BENCH_EXACTNESS, BENCH_DEFAULTS,
    BENCH_LOAD, BENCH_KERNELS, PRIVACY_AUDIT, PRIVACY_PRIVATE_FIRST_STAGE, DRAFTER_TRAIN, DRAFTER_COMPARE,
)


@dataclass(frozen=True)
class Option:
    """One command-line setting: what it is called, holds and means, and which commands take it."""

    name: str  # the parameter's name; the flag is --name with '-' for '_'
    type: Any  # its annotation: int, Optional[str], list[str] (repeatable), a Literal of the choices
    default: Any  # REQUIRED: none
    help: str
    commands: tuple[str, ...]
    unit: str = ""  # what a number counts or measures (a duration or size also names it: --rtt-ms)
    group: str = ""  # the record a command may take it in (`commands.wiring.command`'s keywords)
    flags: tuple[str, ...] = ()  # the declarations where they are not the plain --name: '--sample/--greedy'
    min: int | None = None
    max: int | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)  # per command, where it differs from `default`

    def __post_init__(self) -> None:
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))

    @property
    def flag(self) -> str:
        return self.flags[0] if self.flags else "--" + self.name.replace("_", "-")

    def default_for(self, command: str) -> Any:
        return self.defaults.get(command, self.default)

    @property
    def env(self) -> str:
        """The environment variable a runtime command reads for this option when its command line does not
        give it."""
        return f"{ENV_PREFIX}_{self.name.upper()}"

    def env_in(self, command: str) -> str | None:
        """The variable `command` reads for this option: None in the lab's commands."""
        return self.env if command in RUNTIME else None


def _choices(names: Any) -> Any:
    return Literal[tuple(names)]


SPLIT = (
    Option("model", str, DEFAULT_MODEL, f"{', '.join(map(repr, PACKAGED_MODELS))}, an HF folder or a .gguf file",
           (SERVE, *CLIENTS, ATTEST_WEIGHTS, BENCH_SPECULATION, BENCH_EXACTNESS, DRAFTER_TRAIN, DRAFTER_COMPARE),
           group="split"),
    Option("first", int, 2, "layers the client runs before the server's (K)",
           (SERVE, *CLIENTS, ATTEST_WEIGHTS, BENCH_SPEED), "layers", "split"),
    Option("last", int, 2, "layers the client runs after the server's (M)",
           (SERVE, *CLIENTS, ATTEST_WEIGHTS, BENCH_SPEED), "layers", "split"),
)
PRECISION = (
    Option("dtype", Optional[str], None, "compute dtype of this side's layers: float32, bfloat16 or float16 "
           f"(default: the fastest here; given alone, --quant is none; {COSTS})", (SERVE, *CLIENTS, ATTEST_WEIGHTS),
           group="precision"),
    Option("quant", Optional[str], None, "weight-only quantization of this side's layers: none, int8, int4, or "
           "mixed (int4 where a GGUF shipped 4-bit blocks, kept exactly; int8 elsewhere) "
           "(default: the fastest here; given alone, --dtype is float32)", (SERVE, *CLIENTS, ATTEST_WEIGHTS),
           group="precision"),
    Option("device", str, "cpu", "cpu, cuda or mps (only cpu is verified)", (SERVE, *CLIENTS, ATTEST_WEIGHTS),
           group="precision"),
    Option("exact", bool, False, "float32 with the checkpoint's weights (a client's in-process middle too): "
           "transformers' output, bit for bit, never compiling the CPU kernels (so decoding sequentially)",
           (SERVE, *CLIENTS, ATTEST_WEIGHTS), group="precision", flags=("--exact",)),
)
SERVER = (  # the fields of server.settings.ServerSettings, sizes in the unit their names carry
    Option("max_context", int, 4096, "longest session", (SERVE, BENCH_LOAD), "tokens", "server",
           defaults={BENCH_LOAD: 256}),
    Option("max_sessions", int, 64, "sessions open at once", (SERVE,), "sessions", "server"),
    Option("session_ttl_s", float, 600.0, "idle time before a session is dropped", (SERVE,), "s", "server"),
    Option("max_sessions_per_principal", Optional[int], None, "sessions of one principal (default: a quarter of "
           "--max-sessions with tokens, else all)", (SERVE,), "sessions", "server"),
    Option("max_kv_gib", float, 8.0, "bound on the KV cache memory of all sessions", (SERVE, BENCH_LOAD), "GiB",
           "server", defaults={BENCH_LOAD: 1.0}),
    Option("max_nodes_per_step", int, 256, "positions per step; clients split longer prompts", (SERVE, BENCH_LOAD),
           "positions", "server"),
    Option("max_frame_mib", float, 64.0, "largest WebSocket message accepted", (SERVE,), "MiB", "server"),
    Option("idle_timeout_s", float, 600.0, "time before a silent connection is closed", (SERVE,), "s", "server"),
    Option("send_timeout_s", float, 30.0, "time a peer may take to read a reply", (SERVE,), "s", "server"),
    Option("max_connections", int, 256, "open WebSockets; /health is never refused", (SERVE,), "connections",
           "server"),
    Option("max_connections_per_principal", Optional[int], None, "open WebSockets of one principal (default: a "
           "quarter of --max-connections with tokens, else all)", (SERVE,), "connections", "server"),
    Option("handshake_timeout_s", float, 10.0, "time a connection may take to send its request head", (SERVE,), "s",
           "server"),
    Option("max_header_kib", int, 16, "largest request head (request line and headers)", (SERVE,), "KiB", "server"),
    Option("max_batch_rows", int, 256, "positions in one shared forward pass", (SERVE, BENCH_LOAD), "positions",
           "server"),
    Option("slice_rows", int, 16, "a step longer than --slice-above (a prompt) runs as forwards of this many "
           "positions, others' steps in between", (SERVE, BENCH_LOAD), "positions", "server"),
    Option("slice_above", int, 64, "a step of at most this many positions (a speculative tree) always runs in one "
           "forward", (SERVE,), "positions", "server"),
    Option("max_batch_mib", float, 256.0, "estimated activation and mask memory of one shared forward", (SERVE,),
           "MiB", "server"),
    Option("batch_window_ms", float, 2.0, "steps of different sessions this close together share one forward; "
           "0 disables", (SERVE,), "ms", "server"),
    Option("attestation", str, "none", "evidence offered to clients: none; sev-snp (this SEV-SNP guest's report, "
           "which clients verify); tdx (this TD's quote with its collateral, which clients verify); "
           "simulated (a simulated vendor's report or quote: protects nothing, for tests only). "
           "Anything but none serves sealed sessions only, never with --engine ray, and a machine without "
           "the device refuses to start (docs/confidential.md)",
           (SERVE,), group="server"),
    Option("attestation_sim", Optional[str], None, "folder of `splitllm attest sim-init` (--attestation simulated)",
           (SERVE,), "folder", "server"),
    Option("attestation_collateral", str, "https://api.trustedservices.intel.com", "where --attestation tdx fetches "
           "the collateral clients verify its quotes with (TCB info, QE identity, CRLs): Intel's PCS or a PCCS",
           (SERVE,), "URL", "server"),
)
SERVING = (
    Option("host", str, "127.0.0.1", "address to listen on (client-api: keep it on the trusted device)",
           (SERVE, CLIENT_API)),
    Option("port", int, 8765, "TCP port to listen on", (SERVE, CLIENT_API), min=1, max=65535,
           defaults={CLIENT_API: 8000}),
    Option("log_format", str, "text", "text or json", (SERVE,)),
    Option("tls_cert", Optional[str], None, "PEM certificate chain: serve wss://", (SERVE,), "file", "access"),
    Option("tls_key", Optional[str], None, "PEM private key of --tls-cert", (SERVE,), "file", "access"),
    Option("client_ca", Optional[str], None, "PEM CA: require client certificates it signed (mutual TLS)", (SERVE,),
           "file", "access"),
    Option("auth_token_file", Optional[str], None, "file of 'principal:token' lines; clients must present one",
           (SERVE,), "file", "access"),
    Option("operator", Optional[list[str]], None, "principal whose /health and /metrics show the whole server "
           "(repeatable)", (SERVE,), group="access"),
    Option("engine", str, "uvicorn", "uvicorn (one process) or ray (Ray Serve replicas, never attested)", (SERVE,),
           group="deployment"),
    Option("replicas", int, 1, "Ray Serve replicas (--engine ray)", (SERVE,), group="deployment"),
    Option("ray_address", Optional[str], None, "Ray cluster to deploy on, e.g. 'auto' (--engine ray; default: start "
           "one here)", (SERVE,), group="deployment"),
)
CLIENT = (  # the fields of commands.client_commands.ClientSettings
    Option("server", Optional[str], None, "ws(s)://host:port of a splitllm server; omit to run in-process", CLIENTS,
           group="client"),
    Option("wire_dtype", _choices(WIRE_DTYPE_NAMES), "float16", "hidden states on the wire, each session its own "
           "(float32 makes every mode's output sequential's, bit for bit)", (*CLIENTS, BENCH_SPEED, BENCH_SPECULATION),
           group="client", defaults={BENCH_SPECULATION: "float32"}),
    Option("threads", Optional[int], None, "compute threads (default: the cores this process may use)",
           (SERVE, *CLIENTS, DRAFTER_TRAIN, DRAFTER_COMPARE), "threads", "client"),
    Option("lm_head_dtype", Optional[str], None, "compute dtype of embedding and LM head (default: the layers')",
           CLIENTS, group="client"),
    Option("lm_head_quant", Optional[str], None, "quantization of the LM head (default: the layers')", CLIENTS,
           group="client"),
    Option("token_file", Optional[str], None, "file holding the bearer token (default: $SPLITLLM_TOKEN)", CLIENTS,
           "file", "client"),
    Option("ca", Optional[str], None, "PEM CA bundle to verify a wss:// server (self-signed setups)", CLIENTS, "file",
           "client"),
    Option("insecure", bool, False, "skip wss:// certificate checks (tests only)", CLIENTS, group="client"),
    Option("client_cert", Optional[str], None, "PEM client certificate for mutual TLS", CLIENTS, "file", "client"),
    Option("client_key", Optional[str], None, "PEM key of --client-cert", CLIENTS, "file", "client"),
    Option("fallback", Optional[list[str]], None, "another server to fail over to (repeatable)", CLIENTS,
           group="client"),
    Option("reconnect_deadline_s", float, 60.0, "time to keep trying to reach a server", CLIENTS, "s", "client"),
    Option("drafter", Optional[str], None, "drafter folder (`splitllm drafter train`); default: the shipped one",
           (*CLIENTS, BENCH_SPECULATION), "folder", "client"),
    Option("draft_model", Optional[str], None, "a smaller model with this one's tokenizer (an alias, folder or .gguf), "
           "run whole on the client, that drafts in place of the drafter (default: the model's packaged one, as "
           "qwen2.5-coder-0.5b for qwen2.5-coder-1.5b; none: none)", (*CLIENTS, BENCH_SPECULATION), group="client"),
    Option("attestation_policy", Optional[str], None, "JSON policy a confidential server must prove it meets before "
           "any hidden state is sent; frames are then sealed (docs/confidential.md). Without it the server's "
           "operator can read the states", CLIENTS, "file", "client"),
    Option("max_context", Optional[int], None, "tokens a conversation may hold (default: the model's own limit; a "
           "server may grant fewer, and the caches take memory as they fill)", CLIENTS, "tokens", "client", min=1),
)
SAMPLING = tuple(
    Option(*fields, (GENERATE, CHAT, BENCH_SPECULATION), group="sampling", flags=flags)  # type: ignore[arg-type, call-arg, misc]  # *fields: mypy cannot count them
    for *fields, flags in (
        ("sample", bool, False, "sample instead of taking the argmax", ("--sample/--greedy",)),
        ("temperature", float, 1.0, "divides the logits before sampling", ()),
        ("top_k", int, 0, "keep the k likeliest tokens (0: all)", ()),
        ("top_p", float, 1.0, "keep the likeliest tokens covering this probability", ()),
        ("repetition_penalty", float, 1.0, "weighs against tokens already in the text (1: none)", ()),
        ("seed", Optional[int], None, "fixes the samples", ()),
    )
)
ANSWERS = (
    Option("decode", _choices(Mode), DEFAULT_DECODE, "decoding mode: auto sizes speculation for the link; "
           "greedy output is the same in all", (*CLIENTS, DEMO)),
    Option("max_new_tokens", int, 128, "the most tokens of an answer",
           (GENERATE, CHAT, DEMO, BENCH_SPEED, BENCH_QUALITY, BENCH_STREAMING, BENCH_SWEEP, BENCH_SPECULATION,
            BENCH_CONFIDENTIAL, BENCH_SUFFIX, BENCH_EXACTNESS, BENCH_DEFAULTS, BENCH_LOAD, BENCH_KERNELS,
            DRAFTER_TRAIN, DRAFTER_COMPARE),
           "tokens",
           defaults={CHAT: 256, DEMO: 96, BENCH_SPEED: 64, BENCH_STREAMING: 2000, BENCH_SWEEP: 64,
                     BENCH_SPECULATION: 200, BENCH_CONFIDENTIAL: 64, BENCH_DEFAULTS: 64, BENCH_LOAD: 32,
                     BENCH_KERNELS: 64,
                     DRAFTER_TRAIN: 160, DRAFTER_COMPARE: 160}),
    Option("stop", Optional[list[str]], None, "end the answer before this text (repeatable)", (GENERATE,)),
    Option("raw", bool, False, "skip the chat template", (GENERATE,)),
    Option("as_json", bool, False, "print one JSON object instead of streaming", (GENERATE,), flags=("--json",)),
    Option("system", Optional[str], None, "system prompt", (CHAT,)),
    Option("served_model_name", Optional[str], None, "the model id clients see", (CLIENT_API,)),
    Option("max_conversations", int, 8, "conversations kept open so a follow-up request reads only its new tokens "
           "(0: none)", (CLIENT_API,), "conversations", min=0),
    Option("max_conversation_gib", float, 2.0, "client memory the kept conversations' caches may hold",
           (CLIENT_API,), "GiB", min=0),
    Option("suffix_tokens", int, SUFFIX_TOKENS, "tokens of each API key's earlier requests kept to draft from, "
           "so repeated structure across requests speculates (0: none)", (CLIENT_API,), "tokens", min=0),
    Option("api_keys", Optional[Path], None, "file of API keys, one a line: every /v1 request must then carry one "
           "(Authorization: Bearer KEY), and each key's conversations are kept apart", (CLIENT_API,), "file"),
)
LAB = (
    Option("setting", Optional[str], None,
           "dtype-quant of both sides: bfloat16-mixed, bfloat16-int8, bfloat16-int4, bfloat16-none "
           f"or float32-none (exact) (default: the fastest here; {COSTS})",
           (DEMO, BENCH_SWEEP, BENCH_SPECULATION, BENCH_EXACTNESS)),
    Option("rtt_ms", float, 80.0, "emulated round-trip time",
           (DEMO, NETEM, BENCH_SPECULATION, BENCH_CONVERSATION, BENCH_STRUCTURED, BENCH_SUFFIX, BENCH_DEFAULTS,
            BENCH_LOAD), "ms",
           defaults={BENCH_DEFAULTS: 0.0}),
    Option("listen", str, REQUIRED, "HOST:PORT to listen on (a bare PORT listens on 127.0.0.1)", (NETEM,)),
    Option("target", str, REQUIRED, "HOST:PORT to forward to", (NETEM,)),
    Option("jitter_ms", float, 0.0, "jitter", (NETEM,), "ms"),
    Option("bandwidth_mbit", Optional[float], None, "cap each way", (NETEM,), "Mbit/s"),
    Option("platform", str, "sev-snp", "the vendor the simulation imitates: sev-snp (AMD) or tdx (Intel)",
           (ATTEST_SIM_INIT,)),
    Option("product", str, "milan", "AMD product line the simulation imitates: milan, genoa or turin (sev-snp)",
           (ATTEST_SIM_INIT,)),
    Option("out", str, "results", "folder the command writes its files into (its help names them)", REPORTING,
           "folder", defaults={BENCH_SWEEP: "results/sweep", BENCH_LOAD: "results/load",
                               PRIVACY_AUDIT: "results/privacy", PRIVACY_PRIVATE_FIRST_STAGE: "results/privacy",
                               DRAFTER_TRAIN: REQUIRED}),
    Option("prompts_per_category", int, 1, "workload prompts per category (1-8; 8: the 32-prompt suite)",
           (BENCH_SPEED, BENCH_QUALITY, BENCH_SWEEP, BENCH_SPECULATION, BENCH_CONFIDENTIAL, BENCH_SUFFIX,
            BENCH_EXACTNESS, BENCH_DEFAULTS), "prompts",
           defaults={BENCH_QUALITY: 8, BENCH_SPECULATION: 3, BENCH_SUFFIX: 8, BENCH_EXACTNESS: 8}),
    Option("rtt_ms", str, "0,80", "comma-separated emulated RTTs", (BENCH_SPEED, BENCH_CONFIDENTIAL), "ms"),
    Option("cores", str, "halves", "halves: each side pinned to half the cores (two machines of half this size); "
           "alternate: both sides on every core, computing in turn (two machines of this size); llama.cpp's RPC peer "
           "gets the same cores and threads", LINKED_BENCHES),
    Option("publish", bool, False, "also write the result under docs/results/ and regenerate the doc table made "
           "from it (the command's help names them)", (*LINKED_BENCHES, BENCH_KERNELS)),
    Option("model", str, "default,qwen2.5-coder-1.5b", "comma-separated models",
           (BENCH_CONFIDENTIAL, BENCH_CONVERSATION, BENCH_STRUCTURED, BENCH_SUFFIX, BENCH_KERNELS),
           defaults={BENCH_STRUCTURED: "default,gemma3,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b",
                     BENCH_SUFFIX: "default"}),
)
BENCH = (
    Option("dtype_prompts_per_category", int, 2, "workload prompts per category for the wire dtype check",
           (BENCH_SPEED,), "prompts", "speed"),
    Option("settings", Optional[str], None, "comma-separated dtype-quant settings (default: all measured)",
           (BENCH_SPEED, BENCH_KERNELS), group="speed"),
    Option("variants", Optional[str], None, "comma-separated CPU kernel variants (avx512, avx2, neon; default: every "
           "one this CPU runs)", (BENCH_KERNELS,)),
    Option("prompts", int, 2, "workload prompts decoded per figure (one of each category in turn)", (BENCH_KERNELS,),
           "prompts", min=1, max=4),
    Option("fastest", Optional[str], None, "the setting decoded end to end next to float32-none (default: the "
           "fastest here)", (BENCH_SPEED,), group="speed"),
    Option("threads", str, "1,2", "comma-separated thread counts of the server forward", (BENCH_SPEED,), "threads",
           "speed"),
    Option("model", Optional[str], None, "another model: its speed in-process and split, per precision, beside "
           "llama.cpp on the same GGUF (see `make peers`)", (BENCH_SPEED,), group="speed"),
    Option("settings", str, "bfloat16-none,bfloat16-int8,bfloat16-int4", "comma-separated dtype-quant settings to "
           "compare with float32-none", (BENCH_QUALITY,)),
    Option("ppl_positions", int, 3072, "held-out text positions for perplexity", (BENCH_QUALITY,), "positions"),
    Option("window", int, 100, "steps compared at each end", (BENCH_STREAMING,), "steps"),
    Option("links", str, "0,20,40,80,120,200,80@20", "comma-separated links: RTT ms, or RTT@Mbit/s for a bandwidth "
           "cap", (BENCH_SWEEP,)),
    Option("profile", Optional[str], None, "auto profile to use instead of calibrating one", (BENCH_SWEEP,), "file"),
    Option("merge", bool, False, "keep OUT/steps.json's runs at links not measured now", (BENCH_SWEEP,)),
    Option("reanalyze", bool, False, "measure nothing: rebuild the report from OUT/steps.json", (BENCH_SWEEP,)),
    Option("max_other_cores", float, 0.3, "wait for, and redo generations until, others use fewer cores (0: never)",
           (BENCH_SWEEP,), "cores"),
    Option("quiet_deadline_s", float, 3600.0, "time to wait for quiet moments; then what is left runs regardless",
           (BENCH_SWEEP,), "s"),
    Option("decode", str, "sequential,lookup,lookahead,drafter,auto,auto-static", "comma-separated decoding modes "
           "(sequential always runs; auto-static: auto's static budget; drafter-wide: drafter with 64-node trees, "
           "8 beams of 8; auto-wide: auto choosing from 8 x 8 candidates; auto-serial: auto drafting only between "
           "steps, none while one is in flight; auto-one-step: auto preparing trees in flight but never sending one "
           "ahead)", (BENCH_SPECULATION,)),
    Option("decode", str, "auto,sequential", "comma-separated decoding modes, each measured plain and sealed",
           (BENCH_CONFIDENTIAL,)),
    Option("first_turn_tokens", int, 1500, "about this many tokens in the first turn (a pasted document)",
           (BENCH_CONVERSATION,), "tokens"),
    Option("chats", int, 2, "chats measured per model (after one that warms up)", (BENCH_CONVERSATION,), "chats"),
    Option("max_tokens", int, 128, "the most tokens of each JSON answer", (BENCH_STRUCTURED,), "tokens"),
    Option("clients", str, "1,4,16,64", "comma-separated concurrent client counts (threads sharing one client "
           "model)", (BENCH_LOAD,), group="load"),
    Option("batch_window_ms", str, "0,2", "comma-separated batching windows, one server each; 0: off", (BENCH_LOAD,),
           "ms", "load"),
    Option("ray_replicas", str, "1,2", "comma-separated Ray Serve replica counts, one deployment each (batching on); "
           "empty: none", (BENCH_LOAD,), group="load"),
    Option("prompts", int, 8, "distinct workload prompts, cycled over the clients", (BENCH_LOAD,), "prompts", "load"),
    Option("clients_compute", str, "device", "device: clients replay solo runs, their compute a pause (own devices); "
           "real: all compute here", (BENCH_LOAD,), group="load"),
    Option("prefill", int, 0, "instead: the largest --clients decoders alone, then with one prompt of this many "
           "positions (the server's --max-nodes-per-step, --max-batch-rows and --slice-rows apply to these runs)",
           (BENCH_LOAD,), "positions", "load"),
)
PRIVACY = (
    Option("model", Optional[str], None, "'default', 'gemma3', an HF folder or a .gguf file; --quick: a tiny random "
           "model", (PRIVACY_AUDIT,), group="audit"),
    Option("first", Optional[str], None, "comma-separated depths K (layers before the state is sent) (default: "
           "1,2,4,6,8,12; --quick: 1,2)", (PRIVACY_AUDIT,), "layers", "audit"),
    Option("last", Optional[str], None, "comma-separated depths M (layers after the state is returned) (default: "
           "0,1,2,4,8; --quick: 0,1)", (PRIVACY_AUDIT,), "layers", "audit"),
    Option("quick", bool, False, "tiny random model and small settings, and fail unless every attack behaves (CI)",
           (PRIVACY_AUDIT,), group="audit"),
    Option("reduced", bool, False, "the default model at K 2, M 0, small sets and one setting per defense (for a "
           "busy 2-core machine)", (PRIVACY_AUDIT,), group="audit"),
    Option("train_positions", Optional[int], None, "training positions for the learned attacks (default: 12288)",
           (PRIVACY_AUDIT,), "positions", "audit"),
    Option("test_positions", Optional[int], None, "held-out positions (default: 3072)", (PRIVACY_AUDIT,),
           "positions", "audit"),
    Option("whitebox_windows", Optional[int], None, "whole test windows the white-box search inverts (default: 6)",
           (PRIVACY_AUDIT,), "windows", "audit"),
    Option("long_windows", Optional[int], None, "whole long contexts the white-box search also inverts (default: 2)",
           (PRIVACY_AUDIT,), "windows", "audit"),
    Option("whitebox_max_candidates", int, 8192, "white-box candidates per position on defended states at most (0: "
           "whole vocabulary)", (PRIVACY_AUDIT,), "tokens", "audit"),
    Option("whitebox_exhaustive_positions", Optional[int], None, "positions per window searched over the whole "
           "vocabulary for collisions (default: 4; --reduced: 1; each costs a forward of every token through the "
           "first K layers)", (PRIVACY_AUDIT,), "positions", "audit"),
    Option("update_docs", bool, False, "also publish the report to docs/privacy-audit and regenerate the tables in "
           "docs/privacy.md", (PRIVACY_AUDIT,), group="audit"),
    Option("threads", int, 1, "compute threads", (PRIVACY_AUDIT, PRIVACY_PRIVATE_FIRST_STAGE), "threads"),
    Option("first", str, "2,4,8", "comma-separated depths K to train a private first stage at",
           (PRIVACY_PRIVATE_FIRST_STAGE,), "layers"),
    Option("steps", int, 40, "fine-tuning steps per first stage", (PRIVACY_PRIVATE_FIRST_STAGE,), "steps"),
    Option("kl_budget", float, 0.05, "KL budget from the public next-token distribution",
           (PRIVACY_PRIVATE_FIRST_STAGE,), "nats/token"),
    Option("length", int, 64, "training window", (PRIVACY_PRIVATE_FIRST_STAGE,), "tokens"),
    Option("train_positions", int, 6144, "training positions for the attackers", (PRIVACY_PRIVATE_FIRST_STAGE,),
           "positions"),
    Option("test_positions", int, 3072, "held-out positions", (PRIVACY_PRIVATE_FIRST_STAGE,), "positions"),
    Option("quick", bool, False, "tiny random model and small settings", (PRIVACY_PRIVATE_FIRST_STAGE,)),
)
DRAFTER = (
    Option("prompts", Optional[int], None, "self-distillation conversations the model answers" + RECIPE,
           (DRAFTER_TRAIN,), "conversations", "training"),
    Option("follow_ups", float, 0.3, "share of conversations with a second user turn", (DRAFTER_TRAIN,), "share",
           "training"),
    Option("texts", int, 96, "passages of standard-library prose and code", (DRAFTER_TRAIN,), "passages", "training"),
    Option("generate_batch", Optional[int], None, "prompts answered together (features are taken in the same pass)"
           + RECIPE, (DRAFTER_TRAIN,), "prompts", "training"),
    Option("capture_dtype", str, "bfloat16", "the target's precision while answering: bfloat16 or float32",
           (DRAFTER_TRAIN,), group="training"),
    Option("vocab", int, 8192, "draft vocabulary: the most frequent target tokens", (DRAFTER_TRAIN,), "tokens",
           "training"),
    Option("intermediate", Optional[int], None, "the drafter's MLP width: the recipe's, else the target's; narrower "
           "keeps its strongest channels, wider adds channels", (DRAFTER_TRAIN,), "channels", "training"),
    Option("weights", Optional[str], None, "how the drafter's matrices are stored: float16 or int8" + RECIPE,
           (DRAFTER_TRAIN,), group="training"),
    Option("epochs", Optional[int], None, "passes over the training data" + RECIPE, (DRAFTER_TRAIN,), "epochs",
           "training"),
    Option("passes", int, 3, "unrolled draft steps per position while training", (DRAFTER_TRAIN,), "steps",
           "training"),
    Option("lr", float, 1e-3, "peak learning rate (lower to continue a trained drafter with --init)",
           (DRAFTER_TRAIN,), group="training"),
    Option("feature_weight", float, 1.0, "weight of the feature loss beside the token loss (0: the token loss "
           "alone, as EAGLE-3)", (DRAFTER_TRAIN,), group="training"),
    Option("taps", str, "", "layers whose outputs the drafter fuses with the top feature, e.g. '2,26' for a 28-layer "
           "model split 2+2 (the client's first-stage output and the middle's return)", (DRAFTER_TRAIN,), "layers",
           "training"),
    Option("init", Optional[str], None, "continue from this drafter folder ('shipped': the package's) instead of the "
           "target's last layer", (DRAFTER_TRAIN,), "folder", "training"),
    Option("seed", int, 0, "seed of the conversations drawn and of the training", (DRAFTER_TRAIN,), group="training"),
    Option("work", Optional[str], None, "folder caching answers and features (default: under the cache)",
           (DRAFTER_TRAIN,), "folder"),
    Option("drafter", list[str], REQUIRED, "drafter folder to score (repeat; 'shipped' for the package's)",
           (DRAFTER_COMPARE,), "folder"),
    Option("per_kind", int, 48, "held-out conversations per kind (conversation, code)", (DRAFTER_COMPARE,),
           "conversations"),
    Option("depth", int, 5, "draft depth scored", (DRAFTER_COMPARE,), "tokens"),
)
OPTIONS: tuple[Option, ...] = (
    *SPLIT, *PRECISION, *SERVER, *SERVING, *CLIENT, *SAMPLING, *ANSWERS, *LAB, *BENCH, *PRIVACY, *DRAFTER
)
COMMANDS = (
    SERVE, *CLIENTS, DEMO, NETEM, ATTEST_SIM_INIT, ATTEST_WEIGHTS, BENCH_SPEED, BENCH_QUALITY, BENCH_STREAMING,
    BENCH_SWEEP, BENCH_SPECULATION, BENCH_CONFIDENTIAL, BENCH_CONVERSATION, BENCH_STRUCTURED, BENCH_SUFFIX,
    BENCH_EXACTNESS, BENCH_DEFAULTS, BENCH_LOAD, BENCH_KERNELS, PRIVACY_AUDIT, PRIVACY_PRIVATE_FIRST_STAGE,
    DRAFTER_TRAIN, DRAFTER_COMPARE,
)


def options_of(command: str) -> tuple[Option, ...]:
    """The options `command` takes, in the table's order."""
    return tuple(o for o in OPTIONS if command in o.commands)


def option(command: str, name: str) -> Option:
    """The option `name` of `command`; KeyError if it takes none."""
    for o in options_of(command):
        if o.name == name:
            return o
    raise KeyError(f"`splitllm {command}` takes no option {name!r}")


def defaults_of(command: str) -> Mapping[str, Any]:
    """What `command` runs with for each option not given, by option name."""
    return MappingProxyType({o.name: o.default_for(command) for o in options_of(command)})


@dataclass(frozen=True)
class Split:
    """The model and where it is split: the layers the client runs before (`first`) and after (`last`)
    the server's middle."""

    model: str = option(SERVE, "model").default
    first: int = option(SERVE, "first").default
    last: int = option(SERVE, "last").default


def _form(o: Option) -> str:
    """What an option takes, for the docs: its unit, else its choices, else that it is a flag or a list."""
    kinds = (o.type, *get_args(o.type))
    literal = next((k for k in kinds if get_origin(k) is Literal), None)
    if o.unit:
        return o.unit
    if literal is not None:
        return ", ".join(map(str, get_args(literal)))
    if o.type is bool:
        return "flag"
    return "repeatable" if any(get_origin(k) is list for k in kinds) else ""


def _default(o: Option, command: str) -> str:
    value = o.default_for(command)
    return "required" if value is REQUIRED else "" if value is None else f"`{value}`"


def markdown() -> str:
    """Every command's options as Markdown tables: docs/cli.md's generated part (a test keeps them equal)."""
    sections = []
    for command in COMMANDS:
        if command in RUNTIME:
            header = ["| option | unit | default | environment variable | help |", "| --- | --- | --- | --- | --- |"]
            rows = [f"| `{o.flag}` | {_form(o)} | {_default(o, command)} | `{o.env}` | {o.help} |"
                    for o in options_of(command)]
        else:
            header = ["| option | unit | default | help |", "| --- | --- | --- | --- |"]
            rows = [f"| `{o.flag}` | {_form(o)} | {_default(o, command)} | {o.help} |" for o in options_of(command)]
        header = [f"### `splitllm {command}`", "", *header]
        sections.append("\n".join(header + rows) + "\n")
    return "\n".join(sections)
