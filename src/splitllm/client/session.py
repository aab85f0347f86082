"""The client's public face: text in, text out, with the split model and the server behind it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from splitllm.client.local import LocalModel
from splitllm.client.pipeline import LocalMiddle, Middle, SplitPipeline
from splitllm.client.remote import RemoteMiddle
from splitllm.decoding.sequential import decode_sequential
from splitllm.decoding.step import StepOutput
from splitllm.model.stage import Stage
from splitllm.model.weights import ModelFiles
from splitllm.stats import StepStats, mean_stats

DECODERS = {"sequential": decode_sequential}


@dataclass
class Generation:
    """The result of one generation plus how each step went."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    text: str = ""
    steps: list[StepStats] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def tokens_per_step(self) -> float:
        decode_steps = self.steps[1:]  # the first step is the prefill
        return sum(s.accepted for s in decode_steps) / len(decode_steps) if decode_steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Decode speed: tokens after the first over the time of the steps after the prefill."""
        decode_steps = self.steps[1:]
        ms = sum(s.total_ms for s in decode_steps)
        return sum(s.accepted for s in decode_steps) / ms * 1000 if ms > 0 else 0.0

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
            "prefill": self.steps[0].as_dict() if self.steps else {},
            "mean_step": mean_stats(self.steps[1:]),
        }


class SplitClient:
    """Tokenizer and local layers of a split model, talking to a server (or an in-process middle).

    `server=None` runs the middle layers in this process: the same code path minus the network,
    for tests and offline measurements.
    """

    def __init__(
        self,
        model: str | None = None,
        server: str | None = None,
        head: int = 2,
        tail: int = 2,
        wire_dtype: str = "float16",
        max_context: int = 4096,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.files = ModelFiles(model)
        self.local = LocalModel(self.files, head, tail, dtype)
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(self.files.path)
        self.server, self.wire_dtype, self.max_context, self.dtype = server, wire_dtype, max_context, dtype
        self._local_middle: Stage | None = None
        eos = self.tokenizer.eos_token_id
        gen_eos = getattr(self.files.hf_config, "eos_token_id", None)
        self.stop_ids = frozenset(
            i for i in ([eos] if isinstance(eos, int) else []) + (gen_eos if isinstance(gen_eos, list) else [gen_eos])
            if isinstance(i, int)
        )

    def encode_prompt(self, prompt: str | list[int], chat: bool = True) -> list[int]:
        """Token ids for a prompt; text goes through the chat template when the tokenizer has one."""
        if isinstance(prompt, list):
            return prompt
        if chat and self.tokenizer.chat_template:
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return self.tokenizer(prompt)["input_ids"]

    def _middle(self) -> Middle:
        start, end = self.local.middle_range
        if self.server is None:
            if self._local_middle is None:
                self._local_middle = Stage.load(self.files, start, end, self.dtype)
            return LocalMiddle(self._local_middle, self.max_context)
        return RemoteMiddle(self.server, self.files.fingerprint, (start, end), self.wire_dtype, self.max_context)

    def stream(
        self, prompt: str | list[int], max_new_tokens: int = 128, decode: str = "sequential", chat: bool = True
    ) -> Iterator[tuple[Generation, StepOutput]]:
        """Yield after every step: the generation so far and what the step added."""
        if decode not in DECODERS:
            raise ValueError(f"unknown decode mode {decode!r}; choose from {', '.join(DECODERS)}")
        gen = Generation(self.encode_prompt(prompt, chat))
        if len(gen.prompt_ids) + max_new_tokens > self.max_context:
            raise ValueError(
                f"prompt of {len(gen.prompt_ids)} tokens plus {max_new_tokens} new exceeds the context of {self.max_context}"
            )
        middle = self._middle()
        try:
            pipeline = SplitPipeline(self.local, middle, self.max_context)
            t0 = last = time.perf_counter()
            for out in DECODERS[decode](pipeline, gen.prompt_ids, max_new_tokens, self.stop_ids):
                now = time.perf_counter()
                out.stats.total_ms = (now - last) * 1000
                gen.ids.extend(out.tokens)
                gen.steps.append(out.stats)
                gen.seconds = now - t0
                yield gen, out
                last = time.perf_counter()
            gen.text = self.tokenizer.decode(gen.ids, skip_special_tokens=True)
        finally:
            if isinstance(middle, RemoteMiddle):
                middle.close()

    def generate(
        self, prompt: str | list[int], max_new_tokens: int = 128, decode: str = "sequential", chat: bool = True
    ) -> Generation:
        gen = None
        for gen, _ in self.stream(prompt, max_new_tokens, decode, chat):
            pass
        if gen is None:
            gen = Generation(self.encode_prompt(prompt, chat))
        return gen
