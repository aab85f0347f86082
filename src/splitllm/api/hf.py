"""A transformers-style facade: `from_pretrained` and `generate` over the split model.

Code written for `AutoModelForCausalLM.generate` (token id tensors in and out, `TextStreamer` /
`TextIteratorStreamer`) runs unchanged, while the middle layers run on a splitllm server.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from splitllm.client.client import SplitClient
from splitllm.decoding.modes import DEFAULT_DECODE
from splitllm.decoding.sampling import SamplingParams


class SplitModelForCausalLM:
    def __init__(self, client: SplitClient) -> None:
        self.client = client
        self.config = client.files.hf_config

    @classmethod
    def from_pretrained(
        cls, model: str | None = "default", server: str | None = None, head: int = 2, tail: int = 2, **kwargs: Any
    ) -> SplitModelForCausalLM:
        """`model`: 'default', an HF folder or a .gguf file; `server`: ws(s)://host:port, None runs the
        middle in-process; other keyword arguments go to `SplitClient` (wire_dtype, connection, ...)."""
        return cls(SplitClient(model, server, head, tail, **kwargs))

    @property
    def tokenizer(self):  # type: ignore[no-untyped-def]
        return self.client.tokenizer

    def generate(
        self,
        input_ids: torch.Tensor | Sequence[Sequence[int]],
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int = 128,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 50,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        streamer: Any = None,
        decode: str = DEFAULT_DECODE,
        stop_strings: str | Sequence[str] | None = None,
        pad_token_id: int | None = None,
    ) -> torch.Tensor:
        """Prompt ids (batch, length) -> prompt plus new ids, right-padded with `pad_token_id`.

        Sampling defaults are transformers' (top_k 50); rows run one after another, row i seeded
        with `seed + i`. A streamer gets the prompt, then each step's new ids, then `end()`.
        """
        rows = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else [list(r) for r in input_ids]
        if attention_mask is not None and not bool(torch.as_tensor(attention_mask).all()):
            raise ValueError("padded prompts are not supported: pass each prompt unpadded")
        if streamer is not None and len(rows) != 1:
            raise ValueError("a streamer takes a batch of one prompt")
        stop = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings or [])
        outputs = []
        for i, prompt in enumerate(rows):
            sampling = SamplingParams(
                do_sample=do_sample,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                repetition_penalty=repetition_penalty,
                seed=None if seed is None else seed + i,
            )
            if streamer is not None:
                streamer.put(torch.tensor(prompt))
            new: list[int] = []
            for _, out in self.client.stream(prompt, max_new_tokens, decode, False, sampling, stop):
                new += out.tokens
                if streamer is not None and out.tokens:
                    streamer.put(torch.tensor(out.tokens))
            if streamer is not None:
                streamer.end()
            outputs.append(prompt + new)
        pad = pad_token_id if pad_token_id is not None else self.tokenizer.pad_token_id
        pad = pad if pad is not None else min(self.client.stop_ids, default=0)
        width = max(map(len, outputs))
        return torch.tensor([row + [pad] * (width - len(row)) for row in outputs], dtype=torch.long)
