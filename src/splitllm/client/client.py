"""The client's public face: text in, text out, with the split model and the server behind it."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from splitllm.attestation.policy import AttestationPolicy
from splitllm.client.client_model import ClientModel
from splitllm.client.pipeline import InProcessMiddle, Middle, SplitPipeline
from splitllm.client.connection import ConnectionOptions, ServerUnreachable
from splitllm.client.remote import RemoteMiddle
from splitllm.client.stopping import StopRule, stop_ids
from splitllm.decoding.mode_names import DEFAULT_DECODE
from splitllm.decoding.modes import DECODERS, Decoder, check_mode
from splitllm.decoding.proposers.suffix import SuffixCache
from splitllm.decoding.sampling import Sampler, SamplingParams
from splitllm.decoding.step import StepOutput
from splitllm.model.kv import KVCache
from splitllm.model.precision import Precision, fastest
from splitllm.model.stage import Stage
from splitllm.options import GENERATE, Split, defaults_of
from splitllm.weights.sources import ModelFiles
from splitllm.decoding.sizing.latency import tokens_per_second
from splitllm.stats import SpeculationMetrics, StepStats, mean_stats

__all__ = ["DECODERS", "Conversation", "Decoder", "Generation", "SplitClient"]
_DEFAULTS = defaults_of(GENERATE)  # the Python API's defaults are the client commands' (splitllm.options)

log = logging.getLogger("splitllm.client")


@dataclass
class Generation:
    """The result of one generation plus how each step went."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    text: str = ""  # while streaming, only what later tokens cannot change; final once finished
    steps: list[StepStats] = field(default_factory=list)
    seconds: float = 0.0
    finish_reason: str | None = None  # "stop" (EOS or a stop string), "length", or None while running

    @property
    def tokens_per_step(self) -> float:
        return SpeculationMetrics.of(self.steps[1:]).tokens_per_step  # the first step is the prefill

    @property
    def tokens_per_second(self) -> float:
        """Decode speed: tokens after the first over the time of the steps after the prefill."""
        return tokens_per_second(self.steps[1:])

    def summary(self) -> dict:
        return {
            "text": self.text,
            "ids": self.ids,
            "prompt_tokens": len(self.prompt_ids),
            "new_tokens": len(self.ids),
            "steps": len(self.steps),
            "tokens_per_step": self.tokens_per_step,
            "tokens_per_second": self.tokens_per_second,
            "seconds": self.seconds,
            "finish_reason": self.finish_reason,
            "prefill": self.steps[0].as_dict() if self.steps else {},
            "mean_step": mean_stats(self.steps[1:]),
        }


class SplitClient:
    """Tokenizer and `ClientModel` of a split model, talking to a server (or an in-process middle).

    `server=None` runs the middle layers in this process: the same code path minus the network,
    for tests and offline measurements. `precision` (default: the fastest here, `fastest()`) is the
    client's layers'; `lm_head_precision` (default: the same) the embedding's and LM head's. `drafter`: a
    drafter folder from `splitllm drafter train` (default: the one shipped for this model, if any);
    `draft_model`: a smaller model with this one's tokenizer that drafts instead (`DraftModel`).
    `max_context` (default: the model's own limit) bounds a conversation's positions; the server may
    grant fewer, and the caches are sized to what it grants. `attestation_policy` (a JSON file or an
    `AttestationPolicy`): the server must prove it runs in a confidential VM that meets it before any
    hidden state leaves this process, and every frame is sealed (docs/confidential.md). Without one, the
    server's operator can read the hidden states, which are as good as the text (docs/privacy.md).
    `suffixes`: a `SuffixCache` its generations add their tokens to and draft from (one user's: what one
    principal wrote must not draft for another); None drafts from each generation's own history alone.
    Generate inside `threads.compute_threads_pinned()`, as the client commands do, so that the thread
    pool keeps a core per thread across the round trips' waits.
    """

    def __init__(
        self,
        model: str | None = None,
        server: str | None = None,
        first: int = Split.first,
        last: int = Split.last,
        wire_dtype: str = _DEFAULTS["wire_dtype"],
        max_context: int | None = None,
        precision: Precision | torch.dtype | None = None,
        connection: ConnectionOptions | None = None,
        lm_head_precision: Precision | torch.dtype | None = None,
        drafter: str | Path | None = None,
        draft_model: str | Path | None = None,
        attestation_policy: str | os.PathLike | AttestationPolicy | None = None,
        suffixes: SuffixCache | None = None,
    ) -> None:
        self.connection = _with_policy(connection, attestation_policy, server)  # before any model work
        self.files = ModelFiles(model)
        self.precision = fastest() if precision is None else Precision.of(precision)
        self.client_model = ClientModel(self.files, first, last, self.precision, lm_head_precision, drafter,
                                        draft_model)
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(self.files.path)
        self.server, self.wire_dtype = server, wire_dtype
        self.max_context = self._context(max_context)
        self.dtype = self.precision.dtype
        self._in_process_middle: Stage | None = None
        self.stop_ids = stop_ids(self.tokenizer, self.files.hf_config)
        self.suffixes = suffixes

    def _context(self, wanted: int | None) -> int:
        """Positions a conversation may hold: `wanted`, or the model's own limit (a server may grant fewer).

        The caches fill as a conversation grows, so this only reserves address space; ValueError where
        this device's free memory could not hold the caches it keeps here once they are full."""
        cfg = self.files.config
        limit = cfg.max_position
        context = limit if wanted is None else wanted
        if not 1 <= context <= limit:
            raise ValueError(f"max_context must be between 1 and the model's limit of {limit} tokens, not {context}")
        layers = self.client_model.first_layers + self.client_model.last_layers
        layers += cfg.num_layers - layers if self.server is None else 0  # the in-process middle's too
        need = context * KVCache.position_bytes(layers, cfg.num_kv_heads, cfg.head_dim, self.precision.attention_dtype)
        free = _available_bytes()
        if free is not None and need > free:
            raise ValueError(
                f"a context of {context} tokens needs {need / 2**30:.1f} GiB of KV cache on this device, more than the "
                f"{free / 2**30:.1f} GiB available: ask for a shorter one (--max-context)"
            )
        return context

    def encode_prompt(self, prompt: str | list[int], chat: bool = True) -> list[int]:
        """Token ids for a prompt; text goes through the chat template when the tokenizer has one."""
        if isinstance(prompt, list):
            return prompt
        if chat and self.tokenizer.chat_template:
            ids: Any = self.tokenizer.apply_chat_template(  # a BatchEncoding, or the ids from older transformers
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return self.tokenizer(prompt)["input_ids"]

    def _middle(self) -> Middle:
        start, end = self.client_model.middle_range
        if self.server is None:
            if self._in_process_middle is None:
                self._in_process_middle = Stage.load(self.files, start, end, self.precision)
            return InProcessMiddle(self._in_process_middle, self.max_context)
        return RemoteMiddle(
            self.server, self.files.fingerprint, (start, end), self.wire_dtype, self.max_context, self.connection
        )

    def conversation(self, system: str | None = None, suffixes: SuffixCache | None = None) -> Conversation:
        """A conversation whose turns reuse one server session and the KV caches of earlier turns, drafting
        from `suffixes` too (None: the client's)."""
        return Conversation(self, system, self.suffixes if suffixes is None else suffixes)

    def check_chat(self) -> None:
        """Chat turns go through the tokenizer's chat template; a base model has none."""
        if not self.tokenizer.chat_template:
            raise ValueError("this model has no chat template (a base model): generate from plain text instead")

    def stream(
        self,
        prompt: str | list[int],
        max_new_tokens: int = _DEFAULTS["max_new_tokens"],
        decode: str | Decoder = DEFAULT_DECODE,
        chat: bool = True,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
    ) -> Generator[tuple[Generation, StepOutput], None, None]:
        """Yield after every step: the generation so far and what the step added."""
        with self.conversation() as conv:
            yield from conv.stream(self.encode_prompt(prompt, chat), max_new_tokens, decode, sampling, stop)

    def generate(
        self,
        prompt: str | list[int],
        max_new_tokens: int = _DEFAULTS["max_new_tokens"],
        decode: str | Decoder = DEFAULT_DECODE,
        chat: bool = True,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
    ) -> Generation:
        gen = None
        try:
            for gen, _ in self.stream(prompt, max_new_tokens, decode, chat, sampling, stop):  # noqa: B007 (the last)
                pass
        except ServerUnreachable as exc:
            exc.generation = gen  # the tokens produced before the link was lost stay usable
            raise
        if gen is None:
            gen = Generation(self.encode_prompt(prompt, chat))
        return gen


def _available_bytes() -> int | None:
    """Memory the kernel can still hand out (Linux's MemAvailable), or None where it does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _with_policy(
    connection: ConnectionOptions | None, policy: str | os.PathLike | AttestationPolicy | None, server: str | None
) -> ConnectionOptions | None:
    """The connection options with the attestation policy loaded into them (PolicyError if it is unusable)."""
    if policy is None:
        return connection
    if server is None:
        raise ValueError("an attestation policy verifies a server: it needs a server URL, not the in-process middle")
    policy = policy if isinstance(policy, AttestationPolicy) else AttestationPolicy.load(policy)
    if policy.simulated:
        log.warning("the attestation policy %s trusts a SIMULATED vendor: its evidence proves nothing and protects "
                    "nothing (for tests and development only)", policy.source)
    return dataclasses.replace(connection or ConnectionOptions(), attestation=policy)


class Conversation:
    """One pipeline and its server session kept open across generations that continue each other.

    Each generation sends only its new tokens: the last emitted token of the previous one (never fed)
    plus the new input, with `keep` committing the previous step's path. So the server never sees a
    position twice, and a chat turn costs its own tokens, not the whole history.
    """

    def __init__(self, client: SplitClient, system: str | None = None, suffixes: SuffixCache | None = None) -> None:
        self.client = client
        self.system = system
        self.suffixes = suffixes  # earlier generations to draft from, which this one's tokens join
        self.ids: list[int] = []  # every token so far; the last one is not fed yet
        self.keep: list[int] = []  # the last step's entries on the sequence: the next step commits them
        self.messages: list[dict[str, str]] = []  # the chat as the model saw it (see `say`)
        self._pipeline: SplitPipeline | None = None
        self._decoders: dict[str, Decoder] = {}  # by mode name: this conversation's own policy state

    def __enter__(self) -> Conversation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def nbytes(self) -> int:
        """Client memory this conversation's caches hold: its pipeline's and its draft models'."""
        if self._pipeline is None:
            return 0
        caches = self._pipeline.caches
        total = caches.first.nbytes + (caches.last.nbytes if caches.last is not None else 0)
        for decoder in self._decoders.values():
            drafters = getattr(decoder, "tree_drafters", None)  # a speculative decoder's (sequential has none)
            total += drafters.nbytes if drafters is not None else 0
        return total

    def close(self) -> None:
        """Drop the caches and close the server session; the next turn starts afresh."""
        if self._pipeline is not None and isinstance(self._pipeline.middle, RemoteMiddle):
            self._pipeline.middle.close()
        self._pipeline = None
        self.ids, self.keep, self.messages = [], [], []

    def stream(
        self,
        new_ids: list[int],
        max_new_tokens: int = _DEFAULTS["max_new_tokens"],
        decode: str | Decoder = DEFAULT_DECODE,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
    ) -> Generator[tuple[Generation, StepOutput], None, None]:
        """Append `new_ids` and generate after them; yield after every step like `SplitClient.stream`."""
        client = self.client
        if isinstance(decode, str):
            check_mode(decode)
        if max_new_tokens < 1 or not new_ids:
            raise ValueError("a generation needs input tokens and max_new_tokens >= 1")
        self._check_fits(len(new_ids), max_new_tokens, client.max_context,
                         f"the maximum context of {client.max_context}")
        rule = StopRule(client.tokenizer, client.stop_ids, stop, max_new_tokens)
        if self._pipeline is None:
            self._pipeline = SplitPipeline(client.client_model, client._middle(), client.max_context)
        pipeline = self._pipeline
        granted = pipeline.middle.max_context  # the server may hold fewer positions than we asked for
        self._check_fits(len(new_ids), max_new_tokens, granted, f"the server's maximum context of {granted}; "
                         "shorten the prompt or ask for fewer tokens")
        gen = Generation(list(new_ids))
        feed = self.ids[-1:] + gen.prompt_ids
        self.ids.extend(gen.prompt_ids)
        sampler = Sampler(sampling or SamplingParams(), self.ids)
        decoder = self._decoder(decode)(pipeline, feed, max_new_tokens, client.stop_ids, sampler=sampler,
                                        keep=self.keep)
        pipeline.take_score_ms()
        t0 = last = time.perf_counter()
        try:
            for out in decoder:
                now = time.perf_counter()
                out.stats.timing.decode_ms = (now - last) * 1000 - pipeline.take_score_ms()
                self._take(out, gen, rule)
                gen.seconds = now - t0
                out.stats.timing.total_ms = (time.perf_counter() - last) * 1000  # the bookkeeping above included
                yield gen, out
                if gen.finish_reason:
                    break
                last = time.perf_counter()
        except GeneratorExit:  # the caller stopped listening between steps: everything is consistent
            raise
        except BaseException:
            self.close()  # a step that failed or was interrupted leaves the caches out of step with `ids`
            raise
        finally:
            decoder.close()
            if self.suffixes is not None and self.ids:  # kept unless the generation failed
                self.suffixes.add(gen.prompt_ids + gen.ids)

    def _check_fits(self, new: int, max_new_tokens: int, limit: int, what: str) -> None:
        """A ValueError unless the tokens so far, `new` more and `max_new_tokens` fit in `limit` (`what` it is)."""
        if len(self.ids) + new + max_new_tokens > limit:
            raise ValueError(f"context of {len(self.ids) + new} tokens plus {max_new_tokens} new exceeds {what}")

    def _decoder(self, decode: str | Decoder) -> Decoder:
        """A mode's decoder, one per conversation (its policy state carries over between turns)."""
        if isinstance(decode, str):
            if decode not in self._decoders:
                self._decoders[decode] = DECODERS[decode](suffixes=self.suffixes)
            return self._decoders[decode]
        return decode

    def _take(self, out: StepOutput, gen: Generation, rule: StopRule) -> None:
        """A step's tokens, clipped at a stop, into the generation and the conversation; its path kept
        for the next step to commit."""
        tokens, gen.finish_reason = rule.clip(out.tokens)
        out.path = out.path[: len(out.path) - (len(out.tokens) - len(tokens))]
        if out.stats.speculation.accepted != len(tokens):  # clipped at a stop or at the token limit
            clipped = dataclasses.replace(out.stats.speculation, accepted=len(tokens))
            out.stats = dataclasses.replace(out.stats, speculation=clipped)
        out.tokens = tokens
        gen.ids.extend(tokens)
        self.ids.extend(tokens)
        self.keep = out.path
        gen.steps.append(out.stats)
        gen.text = rule.text(final=gen.finish_reason is not None)

    def say(
        self,
        user: str,
        max_new_tokens: int = _DEFAULTS["max_new_tokens"],
        decode: str | Decoder = DEFAULT_DECODE,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
    ) -> Generator[tuple[Generation, StepOutput], None, None]:
        """One chat turn: the user's message through the chat template, then the streamed answer."""
        messages = [*self.messages, {"role": "user", "content": user}]
        if self.system and not self.messages:
            messages.insert(0, {"role": "system", "content": self.system})
        gen = None
        try:
            for gen, out in self.stream(self._turn_ids(messages), max_new_tokens, decode, sampling, stop):
                yield gen, out
        finally:
            if gen is not None and self.ids:  # answered, even in part, and the caches still hold it
                # What the model saw (a stop string included), so the next template lines up with the cache.
                seen = cast(str, self.client.tokenizer.decode(gen.ids, skip_special_tokens=True))  # one sequence: text
                self.messages = [*messages, {"role": "assistant", "content": seen}]

    def _turn_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The template's tokens for `messages` past what the caches already hold.

        The cache holds the template's text up to the last answer, so the new turn is the template's
        text after it: the answer's closing tags, the user's message and the assistant prompt. A
        template that rewrites earlier turns gets what follows the longest common prefix.
        """
        self.client.check_chat()
        tok = self.client.tokenizer
        # untokenized: text
        full = cast(str, tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        seen = cast(str, tok.decode(self.ids, skip_special_tokens=False))
        return tok(full[len(os.path.commonprefix([full, seen])) :], add_special_tokens=False)["input_ids"]
