"""The target's answers and its features in one batched pass: what a drafter learns from.

Generation runs splitllm's own decoder over every layer, many sequences per step (`Stage.forward_many`:
the rows of all sequences share each weight read, each attends to its own cache), greedy, and keeps the
output of the last layer before the final norm for every position it feeds: the feature the split
client's last stage hands its drafter, computed by the same kernels. A second pass over the answers would cost
as much again as answering them. Text that is not generated (library passages) goes through the same
stack in batched forwards.

bfloat16 is the default: the precision the fastest split setting drafts from, and on CPUs with AMX a
step of 64 rows costs little more than one. Labels stay the target's own distribution, computed from
these features by the client's final norm and LM head (`train.Target`).

With `taps` (layer counts, such as the split's 2 and N - 2), the outputs of those layers come beside
the top feature, each row [tap outputs..., top feature]: what a tapped drafter reads (`drafting.drafter`).
The stack then runs as consecutive stages cut at the taps, the way the split client and server run it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from splitllm.drafting.drafter import check_taps
from splitllm.model.kv import KVCache
from splitllm.model.ends import ModelEnds
from splitllm.model.precision import Precision
from splitllm.model.stage import Stage, Step
from splitllm.weights.sources import ModelFiles
from splitllm.model.visibility import Visibility

PREFILL_ROWS = 8192  # prompt rows fed in one pass at most (bounds the activations of a batch)


class FeatureCapture:
    """The whole target on the client's kernels: embedding, every decoder layer, final norm, LM head."""

    def __init__(
        self, files: ModelFiles, dtype: torch.dtype = torch.bfloat16, stop: Iterable[int] = (), taps: Sequence[int] = ()
    ) -> None:
        """`stop`: the ids that end an answer (`client.stopping.stop_ids`); `taps`: layer counts whose
        outputs come beside the top feature."""
        n = files.config.num_layers
        taps = check_taps(taps, n)
        precision = Precision.of(dtype)
        self.ends = ModelEnds(files, precision)
        cuts = [0, *taps, n]
        self.stages = [Stage.load(files, a, b, precision) for a, b in zip(cuts, cuts[1:])]
        self.eos = frozenset(stop)

    def _new_caches(self, width: int) -> list[KVCache]:
        return [stage.new_cache(width) for stage in self.stages]

    def _run(self, steps: Sequence[tuple[list[KVCache], Step]]) -> list[torch.Tensor]:
        """One step of several sequences through every stage, each sequence with one cache per stage; per
        sequence, [tap outputs..., top feature] along the last dim."""
        outs: list[list[torch.Tensor]] = [[] for _ in steps]
        hidden = [s.inputs for _, s in steps]
        for k, stage in enumerate(self.stages):
            hidden = stage.forward_many([(caches[k], s.with_inputs(h)) for (caches, s), h in zip(steps, hidden)])
            for out, h in zip(outs, hidden):
                out.append(h)
        return [torch.cat(out, dim=-1) for out in outs]

    def _prefill(self, caches: list[list[KVCache]], sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Every position of each sequence through the stack (fresh caches each), in passes of bounded rows."""
        groups: list[list[int]] = [[]]
        for i, s in enumerate(sequences):
            if groups[-1] and sum(len(sequences[j]) for j in groups[-1]) + len(s) > PREFILL_ROWS:
                groups.append([])
            groups[-1].append(i)
        out: list[torch.Tensor] = []
        for group in groups:
            out += self._run([
                (caches[j], Step(self.ends.embed(torch.tensor(sequences[j])), torch.arange(len(sequences[j])),
                                 Visibility.chain(len(sequences[j]))))
                for j in group
            ])
        return out

    @torch.inference_mode()
    def answer(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[tuple[list[int], torch.Tensor]]:
        """Per prompt: prompt + greedy answer ids (through the first end-of-turn token, or max_new_tokens)
        and the features (len(ids), d times 1 + taps) of every position, the last token's included."""
        width = max(map(len, prompts)) + max_new_tokens
        d = self.ends.cfg.hidden_size
        caches = [self._new_caches(width) for _ in prompts]
        feats = [[f] for f in self._prefill(caches, prompts)]
        ids = [list(p) for p in prompts]
        live = list(range(len(prompts)))
        for _ in range(max_new_tokens):
            if not live:
                break
            tokens = self.ends.logits(torch.stack([feats[i][-1][-1, -d:] for i in live])).argmax(-1).tolist()
            steps = []
            for i, t in zip(live, tokens):
                ids[i].append(t)
                steps.append((caches[i], Step(self.ends.embed(torch.tensor([t])), torch.tensor([len(ids[i]) - 1]),
                                              Visibility.chain(1), range(caches[i][0].pending))))
            for i, out in zip(live, self._run(steps)):
                feats[i].append(out)
            live = [i for i in live if ids[i][-1] not in self.eos]
        return [(ids[i], torch.cat(feats[i]).to(torch.float16)) for i in range(len(prompts))]

    @torch.inference_mode()
    def features(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Features (len, d times 1 + taps) of every position of each sequence."""
        caches = [self._new_caches(len(s)) for s in sequences]
        return [f.to(torch.float16) for f in self._prefill(caches, sequences)]
