"""The target's answers and its features in one batched pass: what a drafter learns from.

Generation runs the whole model in batches (left-padded prompts, greedy) with a hook on the last decoder
layer, so each forward step hands over the feature the split client's tail would hand its drafter (the
last layer's output, before the final norm) for every position it fed. A second pass over the answers
would cost as much again as answering them; at 1.5B that is most of the data budget. Text that is not
generated (library passages) goes through the same hook in batched forwards.

bfloat16 is the default: on CPUs with AVX512-BF16 a batch runs ~3x the float32 rate, and it is the
precision the fastest split setting drafts from. Labels stay the target's own distribution, computed
from these features by the client's final norm and LM head (`train.Target`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from splitllm.model.weights import ModelFiles


class FeatureCapture:
    """An HF model of the target whose last decoder layer reports its output on every forward."""

    def __init__(self, files: ModelFiles, dtype: torch.dtype = torch.bfloat16) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(files.path, dtype=dtype).eval()
        self.steps: list[torch.Tensor] = []
        self._last_layer().register_forward_hook(self._record)
        eos = self.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos]) - {None}

    def _last_layer(self) -> nn.Module:
        layers = getattr(getattr(self.model, "model", None), "layers", None)
        if not isinstance(layers, nn.ModuleList) or not len(layers):
            raise ValueError(f"{type(self.model).__name__} has no model.layers to take features from")
        return layers[-1]

    def _record(self, _module: nn.Module, _inputs: object, output: torch.Tensor | tuple) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        self.steps.append(hidden.detach().float())

    @staticmethod
    def _padded(sequences: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded ids and their attention mask (a padded position is never attended to, so any id pads)."""
        width = max(map(len, sequences))
        ids = torch.tensor([[0] * (width - len(s)) + list(s) for s in sequences])
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences])
        return ids, mask

    @torch.inference_mode()
    def answer(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[tuple[list[int], torch.Tensor]]:
        """Per prompt: prompt + greedy answer ids (through the first end-of-turn token) and the features
        (len(ids) - 1, d) of every position but the last, whose feature generation never computes."""
        ids, mask = self._padded(prompts)
        width = ids.shape[1]
        self.steps.clear()
        gen = self.model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=min(self.eos) if self.eos else 0,  # finished rows are cut at their end-of-turn token
        )
        feats = torch.cat(self.steps, dim=1)  # (batch, width + generated - 1, d)
        self.steps.clear()
        out = []
        for b, prompt in enumerate(prompts):
            row = gen[b, width:].tolist()
            end = next((j + 1 for j, t in enumerate(row) if t in self.eos), len(row))
            full = list(prompt) + row[:end]
            start = width - len(prompt)
            have = feats[b, start:].shape[0]  # positions fed: the prompt and all generated tokens but the last
            n = min(len(full), have)
            out.append((full[:n], feats[b, start : start + n].to(torch.float16)))
        return out

    @torch.inference_mode()
    def features(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Features (len, d) of every position of each sequence, in one batched forward."""
        ids, mask = self._padded(sequences)
        self.steps.clear()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, logits_to_keep=1)
        feats = self.steps.pop()
        self.steps.clear()
        width = ids.shape[1]
        return [feats[b, width - len(s) :].to(torch.float16) for b, s in enumerate(sequences)]

