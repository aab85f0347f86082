"""The client's own layers: embedding, first stage, last stage, final norm and LM head, and what it drafts with."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from torch import nn

from splitllm.drafting.draft_model import DraftModel
from splitllm.drafting.drafter import Drafter
from splitllm.drafting.store import load_drafter
from splitllm.model.kv import KVCache
from splitllm.model.ends import ModelEnds
from splitllm.model.precision import Precision
from splitllm.model.stage import Stage, Step
from splitllm.weights.sources import ModelFiles, default_draft_model

log = logging.getLogger(__name__)

NO_DRAFT_MODEL = "none"  # `draft_model` that turns the default draft model off


@dataclass
class ClientCaches:
    first: KVCache
    last: KVCache | None


class ClientModel(ModelEnds):
    """Everything that never leaves the trusted device; reads none of the server's layers.

    `precision` is the first and last stages'; `lm_head_precision` (default: the same) is the embedding's,
    final norm's and LM head's, the client's biggest read. It drafts with a learned drafter (`drafter`:
    a folder, default the one shipped for this model) and with `draft_model`, a smaller model with this
    one's tokenizer run whole on the client (default: the packaged one that drafts for this model, if
    any and no `drafter` folder is named; `"none"`: none); `auto` weighs which pays each step.
    """

    def __init__(
        self,
        files: ModelFiles,
        first: int,
        last: int,
        precision: Precision | torch.dtype = torch.float32,
        lm_head_precision: Precision | torch.dtype | None = None,
        drafter: str | Path | None = None,
        draft_model: str | Path | None = None,
    ) -> None:
        cfg = files.config
        cfg.check_split(first, last)
        self.precision = Precision.of(precision)
        super().__init__(files, self.precision if lm_head_precision is None else lm_head_precision)
        self.dtype = self.precision.dtype
        self.first_layers, self.last_layers = first, last
        self.middle_range = (first, cfg.num_layers - last)
        self.first = Stage.load(files, 0, first, self.precision)
        self.last = Stage.load(files, cfg.num_layers - last, cfg.num_layers, self.precision) if last else None
        self.drafter_path = drafter
        self._vocab_head: tuple[Drafter, nn.Module] | None = None  # see drafter_vocab_head
        # Naming a drafter folder (to measure that drafter) turns the default draft model off.
        self.draft_model_name = default_draft_model(files) if draft_model is None and drafter is None else draft_model
        if drafter is not None:
            _ = self.drafter  # a drafter that does not fit is refused now, not at the first generation
        if draft_model is not None:
            _ = self.draft_model

    @property
    def row_invariant(self) -> bool:
        """Whether the client's stages and LM head give a row the same bits in any step."""
        return (
            self.first.row_invariant and (self.last is None or self.last.row_invariant) and self.lm_head_row_invariant
        )

    @property
    def tap_layers(self) -> tuple[int, int]:
        """The layers whose outputs this client holds besides the top one: its first stage's (K) and the
        middle's it receives (N - M). A tapped drafter reads some of them."""
        return self.middle_range

    @cached_property
    def drafter(self) -> Drafter | None:
        """The drafter of `drafter_path`, else the one shipped for this model, else None. Loaded on first
        use; assign to swap it. It runs in bfloat16 (half the drafting time of float32 on this CPU, and
        drafts are only ever verified), except beside exact layers: there it follows them in float32, so
        the exact mode never compiles the CPU kernels.

        A tapped drafter needs this split to hold the layers it taps: one named by `drafter_path` is
        refused otherwise; the shipped one is left out, with a warning."""
        drafter = load_drafter(self.files, self.drafter_path, torch.float32 if self.precision.exact else torch.bfloat16)
        if drafter is None or set(drafter.taps) <= set(self.tap_layers):
            return drafter
        why = (f"the drafter reads the outputs of layers {list(drafter.taps)}, which the split "
               f"{self.first_layers}+{self.last_layers} does not hold on the client (it holds {list(self.tap_layers)})")
        if self.drafter_path is not None:
            raise ValueError(why)
        log.warning("%s: drafting from context only", why)
        return None

    def drafter_vocab_head(self) -> nn.Module:
        """The LM head's rows of the drafter's draft vocabulary, in the drafter's precision: built once
        per drafter, since reading rows back from a quantized LM head reads all of it (seconds of the
        1.5B's first token: docs/results/drafting-log.md), and every generation's drafting needs them.
        Guesses only: bfloat16 drafts several times faster than float32 here, and a drafter drafting in
        int8 reads these rows in int8 too (at 1.5B they weigh more than its layer)."""
        drafter = self.drafter
        if drafter is None:
            raise ValueError("this client has no drafter")
        if self._vocab_head is None or self._vocab_head[0] is not drafter:
            rows = self.lm_head_rows(drafter.vocab)
            precision = Precision(drafter.dtype, drafter.quant, device=str(rows.device))
            self._vocab_head = (drafter, precision.linear(precision.store_linear(rows)))
        return self._vocab_head[1]

    @cached_property
    def draft_model(self) -> DraftModel | None:
        """The draft model `draft_model_name` names, beside the client's precisions (`DraftModel.for_target`),
        or None. Loaded on first use (a default one too: sequential decoding never loads it); assign to swap it."""
        if self.draft_model_name in (None, NO_DRAFT_MODEL):
            return None
        return DraftModel.for_target(self.files, ModelFiles(self.draft_model_name), self.precision,
                                     self.lm_head_precision)

    def new_caches(self, max_context: int) -> ClientCaches:
        return ClientCaches(self.first.new_cache(max_context), self.last.new_cache(max_context) if self.last else None)

    @torch.inference_mode()
    def run_first(self, caches: ClientCaches, step: Step) -> torch.Tensor:
        """The first stage's outputs for a step of token ids."""
        return self.first(caches.first, step.with_inputs(self.embed(step.inputs))).cpu()

    @torch.inference_mode()
    def run_last(self, caches: ClientCaches, step: Step) -> torch.Tensor:
        """The last stage's outputs for a step of the middle's hidden states."""
        hidden = step.inputs.to(self.precision.torch_device, self.dtype)
        return self.last(caches.last, step.with_inputs(hidden)) if self.last else hidden

