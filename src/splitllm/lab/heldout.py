"""A split model's quality on held-out text, teacher-forced: what a precision or a defense costs."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from splitllm.client.client_model import ClientModel
from splitllm.client.pipeline import Middle, SplitPipeline
from splitllm.lab import rates
from splitllm.model.stage import Step
from splitllm.model.visibility import Visibility


@torch.inference_mode()
def log_probs(client_model: ClientModel, middle: Callable[[], Middle], windows: torch.Tensor) -> torch.Tensor:
    """(n, window, vocab) next-token log-probabilities of held-out windows through the split model."""
    out = []
    for tokens in windows:
        n = len(tokens)
        logits, _ = SplitPipeline(client_model, middle(), n).score(Step(tokens, torch.arange(n), Visibility.chain(n)))
        out.append(F.log_softmax(logits.float(), dim=-1))
    return torch.stack(out)


def quality(windows: torch.Tensor, reference: torch.Tensor, defended: torch.Tensor) -> dict:
    """A defense's cost on held-out text, teacher-forced (every position sees the true prefix):
    perplexity, mean KL(undefended || defended) of the next-token distribution per position, and the
    share of positions whose most likely next token is unchanged."""

    def ppl(lp: torch.Tensor) -> float:
        return float((-lp[:, :-1].gather(-1, windows[:, 1:, None]).mean()).exp())

    kl = (reference.exp() * (reference - defended)).sum(-1)
    base = ppl(reference)
    return {
        "perplexity": ppl(defended),
        "perplexity_ratio": ppl(defended) / base,
        "kl_nats": float(kl.mean()),
        "top1_agreement": rates.of(reference.argmax(-1) == defended.argmax(-1)),
    }
