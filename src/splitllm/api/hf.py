"""A transformers-style facade: `from_pretrained` and `generate` over the split model.

Code written for `AutoModelForCausalLM.generate` (token id tensors in and out, `TextStreamer` /
`TextIteratorStreamer`) runs unchanged, while the middle layers run on a splitllm server.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from splitllm.client.client import SplitClient
from splitllm.decoding.mode_names import DEFAULT_DECODE
from splitllm.decoding.sampling import SamplingParams
from splitllm.options import GENERATE, Split, option


@dataclass(frozen=True)
class GenerationConfig:
    """`SplitModelForCausalLM.generate`'s settings under transformers' names. Its sampling arguments
    (`do_sample`, `temperature`, `top_k`, `top_p`, `repetition_penalty`, `seed`) make `sampling`, with
    transformers' defaults (top_k 50); `decode` is splitllm's decoding mode."""

    max_new_tokens: int = option(GENERATE, "max_new_tokens").default
    sampling: SamplingParams = SamplingParams(top_k=50)
    decode: str = DEFAULT_DECODE
    stop_strings: str | Sequence[str] | None = None
    pad_token_id: int | None = None

    @classmethod
    def of(cls, kwargs: dict[str, Any]) -> GenerationConfig:
        """The settings `generate`'s keyword arguments name; a TypeError names any it does not take."""
        sampling = {f.name for f in fields(SamplingParams)} - {"grammar"}
        own = {f.name for f in fields(cls)} - {"sampling"}
        unknown = sorted(set(kwargs) - sampling - own)
        if unknown:
            raise TypeError(f"generate() got unexpected keyword arguments: {', '.join(unknown)}")
        given = {k: v for k, v in kwargs.items() if k in sampling}
        return cls(**{k: v for k, v in kwargs.items() if k not in sampling}, sampling=replace(cls.sampling, **given))

    def row_sampling(self, row: int) -> SamplingParams:
        """Row `row`'s sampling: seeded with `seed + row`."""
        return replace(self.sampling, seed=None if self.sampling.seed is None else self.sampling.seed + row)

    def stops(self) -> list[str]:
        return [self.stop_strings] if isinstance(self.stop_strings, str) else list(self.stop_strings or [])


class SplitModelForCausalLM:
    def __init__(self, client: SplitClient) -> None:
        self.client = client
        self.config = client.files.hf_config

    @classmethod
    def from_pretrained(
        cls, model: str | None = "default", server: str | None = None, first: int = Split.first, last: int = Split.last,
        **kwargs: Any
    ) -> SplitModelForCausalLM:
        """`model`: 'default', an HF folder or a .gguf file; `server`: ws(s)://host:port, None runs the
        middle in-process; other keyword arguments go to `SplitClient` (wire_dtype, connection, ...)."""
        return cls(SplitClient(model, server, first, last, **kwargs))

    @property
    def tokenizer(self):
        return self.client.tokenizer

    def generate(
        self,
        input_ids: torch.Tensor | Sequence[Sequence[int]],
        attention_mask: torch.Tensor | None = None,
        streamer: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Prompt ids (batch, length) -> prompt plus new ids, right-padded with `pad_token_id`.

        Keyword arguments are `GenerationConfig`'s (transformers' names). Rows run one after another,
        row i seeded with `seed + i`. A streamer gets the prompt, then each step's new ids, then `end()`.
        """
        config = GenerationConfig.of(kwargs)
        rows = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else [list(r) for r in input_ids]
        if attention_mask is not None and not bool(torch.as_tensor(attention_mask).all()):
            raise ValueError("padded prompts are not supported: pass each prompt unpadded")
        if streamer is not None and len(rows) != 1:
            raise ValueError("a streamer takes a batch of one prompt")
        outputs = [prompt + self._new_ids(prompt, config, config.row_sampling(i), streamer)
                   for i, prompt in enumerate(rows)]
        pad = config.pad_token_id if config.pad_token_id is not None else self.tokenizer.pad_token_id
        pad = pad if pad is not None else min(self.client.stop_ids, default=0)
        width = max(map(len, outputs))
        return torch.tensor([row + [pad] * (width - len(row)) for row in outputs], dtype=torch.long)

    def _new_ids(self, prompt: list[int], config: GenerationConfig, sampling: SamplingParams,
                 streamer: Any) -> list[int]:
        """One row's new ids, streamed as they come."""
        if streamer is not None:
            streamer.put(torch.tensor(prompt))
        new: list[int] = []
        for _, out in self.client.stream(prompt, config.max_new_tokens, config.decode, False, sampling, config.stops()):
            new += out.tokens
            if streamer is not None and out.tokens:
                streamer.put(torch.tensor(out.tokens))
        if streamer is not None:
            streamer.end()
        return new
