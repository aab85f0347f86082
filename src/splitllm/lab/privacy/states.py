"""The public model as an attacker holds it: every layer, cut at the depths being audited.

`StageStack` runs consecutive `Stage`s as one, each with its own cache, and can hand back the
residual stream at every cut: one pass over a window yields the state the server would see for
every first-stage depth K (after layer K) and every last-stage depth M (before the last M layers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitllm.client.client_model import ClientModel
from splitllm.model.kv import KVCache
from splitllm.model.stage import Stage, Step
from splitllm.weights.sources import ModelFiles
from splitllm.model.visibility import Visibility

WIRE_DTYPE = torch.float16  # what the client sends by default: the server sees states rounded to it


class StageStack:
    """Consecutive stages [b0, b1), [b1, b2), ... run as one; `forward` returns the state at every cut."""

    def __init__(self, stages: Sequence[Stage]) -> None:
        self.stages = list(stages)
        self.cuts = [s.end for s in self.stages]

    def upto(self, layer: int) -> StageStack:
        """The stages that end at or before `layer` (which must be a cut)."""
        if layer not in self.cuts:
            raise ValueError(f"layer {layer} is not one of the cuts {self.cuts}")
        return StageStack(self.stages[: self.cuts.index(layer) + 1])

    def between(self, start: int, end: int) -> StageStack:
        """The stages covering layers [start, end) (both must be cuts or 0); may be empty."""
        return StageStack([s for s in self.stages if start <= s.start and s.end <= end])

    def new_caches(self, max_context: int) -> list[KVCache]:
        return [s.new_cache(max_context) for s in self.stages]

    def forward(
        self, caches: list[KVCache], hidden: torch.Tensor, positions: torch.Tensor, vis: Visibility, keep: Sequence[int]
    ) -> dict[int, torch.Tensor]:
        """{cut: (n, d) state after that layer} for one step through every stage."""
        out = {}
        for stage, cache in zip(self.stages, caches):
            hidden = stage(cache, Step(hidden, positions, vis, keep))
            out[stage.end] = hidden
        return out


@dataclass
class WindowStates:
    """Per cut, the wire-rounded states of a set of windows, plus the model's greedy next tokens."""

    states: dict[int, torch.Tensor]  # cut -> (n_windows, window, d), WIRE_DTYPE
    greedy: torch.Tensor  # (n_windows, window): argmax of the logits at each position
    top5: torch.Tensor  # (n_windows, window, 5): the five most likely next tokens
    sampled: dict[float, torch.Tensor]  # temperature -> (n_windows, window) one seeded draw per position
    top_prob: dict[float, torch.Tensor]  # temperature -> (n_windows, window) probability of the argmax


TEMPERATURES = (0.7, 1.0)


class PublicModel:
    """All public weights: embedding, every layer (cut at the audited depths), final norm, LM head."""

    def __init__(self, files: ModelFiles, cuts: Sequence[int], dtype: torch.dtype = torch.float32) -> None:
        n = files.config.num_layers
        cuts = sorted(set(cuts) | {n})
        if cuts[0] < 1:
            raise ValueError("cuts must lie in [1, num_layers]")
        # ClientModel reads the embedding, norm and LM head; its first stage is the stack's first.
        self.client_model = ClientModel(files, cuts[0], 0, dtype)
        stages = [self.client_model.first] + [Stage.load(files, a, b, dtype) for a, b in zip(cuts, cuts[1:])]
        self.stack = StageStack(stages)
        self.files, self.cfg, self.dtype = files, files.config, dtype
        self.embed = self.client_model.input_table()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.client_model.logits(hidden)

    @torch.inference_mode()
    def window_states(self, windows: torch.Tensor, cuts: Sequence[int], seed: int = 0) -> WindowStates:
        """Run each window from position 0 and keep the states at the asked cuts, the next-token
        argmax and top 5, and a seeded sample at each of `TEMPERATURES`."""
        n, length = windows.shape
        gen = torch.Generator().manual_seed(seed)
        positions = torch.arange(length)
        vis = Visibility.chain(length)
        states = {c: torch.empty(n, length, self.cfg.hidden_size, dtype=WIRE_DTYPE) for c in cuts}
        top5 = torch.empty(n, length, 5, dtype=torch.long)
        sampled = {t: torch.empty(n, length, dtype=torch.long) for t in TEMPERATURES}
        top_prob = {t: torch.empty(n, length) for t in TEMPERATURES}
        for i in range(n):
            caches = self.stack.new_caches(length)
            out = self.stack.forward(caches, self.embed[windows[i]], positions, vis, [])
            for c in cuts:
                states[c][i] = out[c].to(WIRE_DTYPE)
            logits = self.logits(out[self.cfg.num_layers]).float()
            top5[i] = logits.topk(5, dim=-1).indices
            for t in TEMPERATURES:
                probs = (logits / t).softmax(-1)
                sampled[t][i] = torch.multinomial(probs, 1, generator=gen)[:, 0]
                top_prob[t][i] = probs.max(-1).values
        return WindowStates(states, top5[..., 0].clone(), top5, sampled, top_prob)
