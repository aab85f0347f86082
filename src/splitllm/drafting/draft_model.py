"""A whole smaller model of the target's family as its drafter, run on the client.

Where a model family ships a small sibling with the same tokenizer (Qwen2.5-Coder 0.5B beside 1.5B),
that sibling predicts the target's greedy tokens far more often than a one-layer drafter trained
here can: on the 1.5B's own answers the 0.5B's next token is the 1.5B's far more often than the
shipped drafter's first guess is (docs/results/drafting-log.md). It
drafts from the committed tokens alone (no target features), so nothing about it crosses the wire:
the client holds it whole, embedding to LM head. What it costs is client time, one pass of all its
layers per tree depth, which `auto`'s gate weighs against what it gains; its guesses are only ever
verified, so beside quantized client layers its own layers keep int4 weights (`drafting_precision`).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import AutoTokenizer

from splitllm.model.kv import KVCache
from splitllm.model.ends import ModelEnds
from splitllm.kernels import cpu_kernels
from splitllm.model.precision import Precision
from splitllm.model.stage import Stage
from splitllm.weights.sources import ModelFiles


def check_same_tokenizer(target: ModelFiles, draft: ModelFiles) -> None:
    """A draft model must name tokens by the target's ids: same vocabulary size and token table."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary has {draft.config.vocab_size} tokens and the target's "
            f"{target.config.vocab_size}: a draft model needs the target's tokenizer"
        )
    ours, theirs = (AutoTokenizer.from_pretrained(f.path).get_vocab() for f in (target, draft))
    if ours != theirs:
        differ = sum(1 for t, i in ours.items() if theirs.get(t) != i)
        raise ValueError(f"the draft model's tokenizer differs from the target's ({differ} tokens map elsewhere)")


def drafting_precision(client: Precision) -> Precision:
    """The precision of a draft model's layers (or LM head) beside a client's layers (or LM head) of
    `client`: wherever the client's are quantized on the CPU and the kernels run, int4 (the leanest form
    they run), else the client's own (the exact mode stays exact).

    With AVX-512 BF16, on one core a pass of the 0.5B Qwen over a tree's depth reads its weights once and
    multiplies them for each row: int4 weights take a third off a lone row's pass and a seventh off four
    rows', its tokens per step held; an int4 LM head took a further quarter off the drafting time a step
    (docs/results/drafting-log.md, "An int4 draft model"). Every variant multiplies int4 in integers, so
    int4 is the fastest form on AVX2 and NEON too (docs/results/kernels.json)."""
    if client.quant == "none" or client.torch_device.type != "cpu" or cpu_kernels.chosen() is None:
        return client
    return replace(client, quant="int4")


class DraftModel(ModelEnds):
    """Every layer of a draft model over its own cache, with its embedding, final norm and LM head.

    A whole smaller model that drafts from tokens alone, not the learned `Drafter` (one trained layer).
    """

    def __init__(
        self, files: ModelFiles, precision: Precision | torch.dtype,
        lm_head_precision: Precision | torch.dtype | None = None
    ) -> None:
        self.precision = Precision.of(precision)
        super().__init__(files, self.precision if lm_head_precision is None else lm_head_precision)
        self.stage = Stage.load(files, 0, files.config.num_layers, self.precision)

    @classmethod
    def for_target(
        cls, target: ModelFiles, draft: ModelFiles, precision: Precision, lm_head_precision: Precision | None = None
    ) -> DraftModel:
        """`draft` loaded to draft for `target` beside client layers of `precision` and a client LM head of
        `lm_head_precision` (its layers and LM head in their `drafting_precision`), refused with a clear
        error if it names tokens differently."""
        check_same_tokenizer(target, draft)
        return cls(draft, drafting_precision(precision), drafting_precision(lm_head_precision or precision))

    @property
    def max_position(self) -> int:
        return self.cfg.max_position

    def new_cache(self, max_context: int) -> KVCache:
        return self.stage.new_cache(max_context)

    def grow(self, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor, sees: torch.Tensor) -> torch.Tensor:
        """The last layer's outputs at n tokens appended to `cache` (`Stage.extend`)."""
        return self.stage.extend(cache, self.embed(tokens), positions, sees)

    @torch.inference_mode()
    def probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token distributions over the whole vocabulary after the given last-layer outputs."""
        return torch.softmax(self.approx_logits(hidden), dim=-1)
