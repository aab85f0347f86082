"""The client's own layers: embedding, head stage, tail stage, final norm and LM head."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from splitllm.draft.model import Drafter
from splitllm.draft.store import load_drafter
from splitllm.kv import KVCache
from splitllm.model.blocks import rms_norm
from splitllm.model.precision import Precision
from splitllm.model.quant import BlockedLinear, Linear, PackedLinear, on_huge_pages
from splitllm.model.stage import Stage, read_norm
from splitllm.model.store import StoredWeights
from splitllm.model.weights import ModelFiles
from splitllm.visibility import Visibility

log = logging.getLogger(__name__)

ROW_BY_ROW = 8  # up to this many rows, the LM head runs row by row (see LocalModel.logits)


@dataclass
class LocalCaches:
    head: KVCache
    tail: KVCache | None


class LocalModel:
    """Everything that never leaves the trusted device; reads none of the server's layers.

    `precision` is the head and tail stages'; `lm_head_precision` (default: the same) is the embedding's,
    final norm's and LM head's, the client's biggest read.
    """

    def __init__(
        self,
        files: ModelFiles,
        head: int,
        tail: int,
        precision: Precision | torch.dtype = torch.float32,
        lm_head_precision: Precision | torch.dtype | None = None,
        drafter: str | Path | None = None,
    ) -> None:
        cfg = files.config
        cfg.check_split(head, tail)
        self.precision = Precision.of(precision)
        self.lm_head_precision = self.precision if lm_head_precision is None else Precision.of(lm_head_precision)
        self.files, self.cfg, self.dtype = files, cfg, self.precision.dtype
        self.head_layers, self.tail_layers = head, tail
        self.middle_range = (head, cfg.num_layers - tail)
        embed_name = "model.embed_tokens.weight"
        head_name = embed_name if cfg.tie_word_embeddings or not files.has("lm_head.weight") else "lm_head.weight"
        weights = StoredWeights(files, self.lm_head_precision)
        self.embed_weight = self.lm_head_precision.dense(weights.dense([embed_name])[embed_name])
        self.norm = read_norm(weights, "model.norm.weight")
        # Gemma scales embeddings by sqrt(hidden), rounded to the compute dtype as transformers does.
        scale = torch.tensor(cfg.embed_scale).to(self.embed_weight.device, self.embed_weight.dtype)
        self.embed_scale = scale if cfg.embed_scale != 1.0 else None
        self._tied_dense = head_name == embed_name and self.lm_head_precision.quant == "none"
        self.lm_head = (
            self.lm_head_precision.linear({"weight": self.embed_weight}) if self._tied_dense else weights.linear([head_name])
        )
        on_huge_pages([self.lm_head])  # the client's biggest read
        # float32 (and float64) matrix products round differently for one row and for many (see `logits`).
        wide = (torch.float32, torch.float64)
        self._row_by_row = isinstance(self.lm_head, Linear) and self.lm_head.weight.dtype in wide
        self.head = Stage.load(files, 0, head, self.precision)
        self.tail = Stage.load(files, cfg.num_layers - tail, cfg.num_layers, self.precision) if tail else None
        self.drafter_path = drafter
        if drafter is not None:
            self.drafter  # a drafter folder that does not fit is refused now, not at the first generation

    @property
    def tap_layers(self) -> tuple[int, int]:
        """The layers whose outputs this client holds besides the top one: its head's (K) and the
        middle's it receives (N - M). A fused drafter reads some of them."""
        return self.middle_range

    @cached_property
    def drafter(self) -> Drafter | None:
        """The drafter of `drafter_path`, else the one shipped for this model, else None (drafting
        then uses n-gram sources only). Loaded on first use; assign to swap it. It runs in bfloat16:
        half the drafting time of float32 on this CPU, and drafts are only ever verified.

        A fused drafter needs this split to hold the layers it taps: one named by `drafter_path` is
        refused otherwise; the shipped one is left out, with a warning."""
        head = load_drafter(self.files, self.drafter_path, torch.bfloat16)
        if head is None or set(head.taps) <= set(self.tap_layers):
            return head
        why = (f"the drafter reads the outputs of layers {list(head.taps)}, which the split "
               f"{self.head_layers}+{self.tail_layers} does not hold on the client (it holds {list(self.tap_layers)})")
        if self.drafter_path is not None:
            raise ValueError(why)
        log.warning("%s: drafting from context only", why)
        return None

    def lm_head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dense rows of the LM head for token `ids` (a draft vocabulary), whatever form the head is
        stored in: a quantized head is read back through its own kernel, once, at the cost of a
        hidden-size-row product. A tied head's rows are the embedding's (a packed head would have to
        unpack all of its rows first)."""
        if self._tied_dense or isinstance(self.lm_head, (Linear, PackedLinear, BlockedLinear)):
            weight = self.embed_weight if self._tied_dense else self.lm_head.weight
            return weight[ids.to(weight.device)]
        hp = self.lm_head_precision
        eye = torch.eye(self.cfg.hidden_size, dtype=hp.dtype, device=hp.torch_device)
        return self.lm_head(eye).T[ids.to(hp.torch_device)]

    def new_caches(self, max_context: int) -> LocalCaches:
        return LocalCaches(self.head.new_cache(max_context), self.tail.new_cache(max_context) if self.tail else None)

    @torch.inference_mode()
    def run_head(
        self, caches: LocalCaches, tokens: torch.Tensor, positions: torch.Tensor, vis: Visibility, keep: Sequence[int]
    ) -> torch.Tensor:
        return self.head(caches.head, self.embed(tokens), positions, vis, keep).cpu()

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The hidden states entering layer 0."""
        x = self.embed_weight[tokens.to(self.embed_weight.device)]
        return x if self.embed_scale is None else x * self.embed_scale

    def input_table(self) -> torch.Tensor:
        """The whole table as layer 0 sees it, for code that indexes it: a scaled copy when the model scales."""
        return self.embed_weight if self.embed_scale is None else self.embed_weight * self.embed_scale

    @torch.inference_mode()
    def run_tail(
        self, caches: LocalCaches, hidden: torch.Tensor, positions: torch.Tensor, vis: Visibility, keep: Sequence[int]
    ) -> torch.Tensor:
        hidden = hidden.to(self.precision.torch_device, self.dtype)
        return self.tail(caches.tail, hidden, positions, vis, keep) if self.tail else hidden

    @property
    def shared_logit_rows(self) -> int:
        """How many rows' logits cost about one row's: a read of the LM head shared by a batch whose
        rows keep their own bits (splitllm's kernels, on AMX's tiles); 1 where every row costs its own."""
        return self.lm_head.shared_rows if isinstance(self.lm_head, BlockedLinear) else 1

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (on the CPU, at least float32) over the given rows only: callers pass just the nodes the verifier needs.

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
    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Approximate logits (a 16-bit or quantized LM head) for guesses that are never committed unverified."""
        return self._softcap(self._drafting_lm_head(self.normed(hidden)).float().cpu())

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def normed(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm, in the LM head's precision: what the LM head multiplies."""
        hp = self.lm_head_precision
        return rms_norm(hidden.to(hp.torch_device, hp.dtype), self.norm, self.cfg.rms_norm_eps)

    @cached_property
    def _drafting_lm_head(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The LM head drafts read: a float32 one again as bfloat16; any other is cheap already."""
        if not self._row_by_row:
            return self.lm_head
        head = Linear(self.lm_head.weight.to(torch.bfloat16))
        return lambda x: head(x.to(torch.bfloat16))
