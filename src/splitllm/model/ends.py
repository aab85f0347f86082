"""The two ends of a decoder: the token embedding, final norm and LM head, which turn tokens into states
and states into logits."""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import cast

import torch

from splitllm.model.blocks import rms_norm
from splitllm.model.precision import Precision
from splitllm.model.quant import BlockedLinear, Linear, PackedLinear, on_huge_pages
from splitllm.model.stage import read_norm
from splitllm.weights.conversions import StoredWeights
from splitllm.weights.sources import ModelFiles

ROW_BY_ROW = 8  # up to this many rows, the LM head runs row by row (see ModelEnds.logits)


class ModelEnds:
    """A model's embedding, final norm and LM head in `lm_head_precision`; reads none of its layers.

    The split client holds them (`ClientModel`), and so does code that needs a model's vocabulary side
    without its layers: a whole draft model, a drafter's training targets.
    """

    def __init__(self, files: ModelFiles, lm_head_precision: Precision | torch.dtype = torch.float32) -> None:
        cfg = files.config
        self.files, self.cfg = files, cfg
        self.lm_head_precision = Precision.of(lm_head_precision)
        embed_name = "model.embed_tokens.weight"
        head_name = embed_name if cfg.tie_word_embeddings or not files.has("lm_head.weight") else "lm_head.weight"
        weights = StoredWeights(files, self.lm_head_precision, {embed_name, "model.norm.weight", head_name})
        self.embed_weight = self.lm_head_precision.dense(weights.dense([embed_name])[embed_name])
        self.norm = read_norm(weights, "model.norm.weight")
        # Gemma scales embeddings by sqrt(hidden), rounded to the compute dtype as transformers does.
        scale = torch.tensor(cfg.embed_scale).to(self.embed_weight.device, self.embed_weight.dtype)
        self.embed_scale = scale if cfg.embed_scale != 1.0 else None
        self._tied_dense = head_name == embed_name and self.lm_head_precision.quant == "none"
        self.lm_head = (
            self.lm_head_precision.linear({"weight": self.embed_weight}) if self._tied_dense
            else weights.linear([head_name])
        )
        on_huge_pages([self.lm_head])  # the biggest read outside the layers
        # float32 (and float64) matrix products round differently for one row and for many (see `logits`).
        wide = (torch.float32, torch.float64)
        self._row_by_row = isinstance(self.lm_head, Linear) and self.lm_head.weight.dtype in wide

    def lm_head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dense rows of the LM head for token `ids` (a draft vocabulary), whatever form the head is
        stored in: a quantized head is read back through its own kernel, once, at the cost of a
        hidden-size-row product. A tied head's rows are the embedding's (a packed head would have to
        unpack all of its rows first)."""
        if self._tied_dense or isinstance(self.lm_head, (Linear, PackedLinear, BlockedLinear)):
            # one of the linears above
            weight = self.embed_weight if self._tied_dense else cast(torch.Tensor, self.lm_head.weight)
            return weight[ids.to(weight.device)]
        hp = self.lm_head_precision
        eye = torch.eye(self.cfg.hidden_size, dtype=hp.dtype, device=hp.torch_device)
        return self.lm_head(eye).T[ids.to(hp.torch_device)]


    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The hidden states entering layer 0."""
        x = self.embed_weight[tokens.to(self.embed_weight.device)]
        return x if self.embed_scale is None else x * self.embed_scale

    def input_table(self) -> torch.Tensor:
        """The whole table as layer 0 sees it, for code that indexes it: a scaled copy when the model scales."""
        return self.embed_weight if self.embed_scale is None else self.embed_weight * self.embed_scale

    @property
    def shared_logit_rows(self) -> int:
        """How many rows' logits cost about one row's: a read of the LM head shared by a batch whose
        rows keep their own bits (splitllm's kernels, on AMX's tiles); 1 where every row costs its own."""
        return self.lm_head.shared_rows if isinstance(self.lm_head, BlockedLinear) else 1

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (on the CPU, at least float32) over the given rows only: callers pass just the nodes the
        verifier needs.

        With a float32 head, a few rows go one at a time through the matrix-vector kernel, so a
        row's logits are the same bits however many rows a decoder scores, and the same as
        transformers' one-token steps (MKL's multi-row kernels round differently); many rows (a
        whole prompt) take one matrix product. The 16-bit and quantized kernels give every row the
        same bits in any batch, so they always take all rows at once.
        """
        x = self.normed(hidden)
        if self._row_by_row and 0 < x.shape[0] <= ROW_BY_ROW:
            out = torch.cat([self.lm_head(row) for row in x.split(1)])
        else:
            out = self.lm_head(x)
        return self._softcap(out.to("cpu", torch.promote_types(out.dtype, torch.float32)))

    @torch.inference_mode()
    def approx_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Approximate logits (a 16-bit or quantized LM head) for guesses that are never committed unverified."""
        return self._softcap(self._approx_lm_head(self.normed(hidden)).float().cpu())

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def normed(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm, in the LM head's precision: what the LM head multiplies."""
        hp = self.lm_head_precision
        return rms_norm(hidden.to(hp.torch_device, hp.dtype), self.norm, self.cfg.rms_norm_eps)

    @property
    def lm_head_row_invariant(self) -> bool:
        """Whether a row's logits are the same bits in any batch: splitllm's kernel, or a float head taken
        row by row."""
        return isinstance(self.lm_head, BlockedLinear) or self._row_by_row

    @cached_property
    def _approx_lm_head(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The LM head `approx_logits` reads: a float32 one again as bfloat16; any other is cheap already."""
        if not self._row_by_row:
            return self.lm_head
        assert isinstance(self.lm_head, Linear)  # row by row: a dense float head (__init__)
        head = Linear(self.lm_head.weight.to(torch.bfloat16))
        return lambda x: head(x.to(torch.bfloat16))

