"""The client's own layers: embedding, head stage, tail stage, final norm and LM head."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from splitllm.kv import KVCache
from splitllm.model.blocks import rms_norm
from splitllm.model.stage import Stage, read_norm
from splitllm.model.weights import ModelFiles
from splitllm.visibility import Visibility

ROW_BY_ROW = 8  # up to this many rows, the LM head runs row by row (see LocalModel.logits)


@dataclass
class LocalCaches:
    head: KVCache
    tail: KVCache | None


class LocalModel:
    """Everything that never leaves the trusted device; reads none of the server's layers."""

    def __init__(self, files: ModelFiles, head: int, tail: int, dtype: torch.dtype = torch.float32) -> None:
        cfg = files.config
        cfg.check_split(head, tail)
        self.files, self.cfg, self.dtype = files, cfg, dtype
        self.head_layers, self.tail_layers = head, tail
        self.middle_range = (head, cfg.num_layers - tail)
        embed_name = "model.embed_tokens.weight"
        head_name = embed_name if cfg.tie_word_embeddings or not files.has("lm_head.weight") else "lm_head.weight"
        w = files.read({embed_name, head_name}, dtype)
        self.embed_weight = w[embed_name]
        self.lm_head = w[head_name]
        self.norm = read_norm(files, "model.norm.weight", dtype)
        # Gemma scales embeddings by sqrt(hidden), rounded to the compute dtype as transformers does.
        self.embed_scale = torch.tensor(cfg.embed_scale).to(dtype) if cfg.embed_scale != 1.0 else None
        self.head = Stage.load(files, 0, head, dtype)
        self.tail = Stage.load(files, cfg.num_layers - tail, cfg.num_layers, dtype) if tail else None

    def new_caches(self, max_context: int) -> LocalCaches:
        return LocalCaches(self.head.new_cache(max_context), self.tail.new_cache(max_context) if self.tail else None)

    @torch.inference_mode()
    def run_head(
        self, caches: LocalCaches, tokens: torch.Tensor, positions: torch.Tensor, vis: Visibility, keep: Sequence[int]
    ) -> torch.Tensor:
        return self.head(caches.head, self.embed(tokens), positions, vis, keep)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The hidden states entering layer 0."""
        x = self.embed_weight[tokens]
        return x if self.embed_scale is None else x * self.embed_scale

    def input_table(self) -> torch.Tensor:
        """The whole table as layer 0 sees it, for code that indexes it: a scaled copy when the model scales."""
        return self.embed_weight if self.embed_scale is None else self.embed_weight * self.embed_scale

    @torch.inference_mode()
    def run_tail(
        self, caches: LocalCaches, hidden: torch.Tensor, positions: torch.Tensor, vis: Visibility, keep: Sequence[int]
    ) -> torch.Tensor:
        hidden = hidden.to(self.dtype)
        return self.tail(caches.tail, hidden, positions, vis, keep) if self.tail else hidden

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head over the given rows only: callers pass just the nodes the verifier needs.

        A few rows go one at a time through the matrix-vector kernel, so a row's logits are the
        same bits however many rows a decoder scores, and the same as transformers' one-token
        steps (MKL's multi-row kernels round differently); many rows (a whole prompt) take one
        matrix product. A transposed contiguous copy of the head runs one row 1.8x faster, but
        rounds differently from the reference, so it is not used.
        """
        x = rms_norm(hidden, self.norm, self.cfg.rms_norm_eps)
        if not 0 < x.shape[0] <= ROW_BY_ROW:
            return self._softcap(x @ self.lm_head.T)
        return self._softcap(torch.cat([row @ self.lm_head.T for row in x.split(1)]))

    @torch.inference_mode()
    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Approximate logits (bfloat16 LM head) for guesses that are never committed unverified."""
        x = rms_norm(hidden, self.norm, self.cfg.rms_norm_eps)
        return self._softcap(F.linear(x.to(torch.bfloat16), self._draft_head).float())

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @cached_property
    def _draft_head(self) -> torch.Tensor:
        return self.lm_head.to(torch.bfloat16)
