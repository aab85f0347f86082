"""Output side: from the state the server returns (before the client's last M layers), guess the
token the client will generate next.

White-box, the server runs the public last M layers, final norm and LM head over the states it
computed, exactly as the client does; a learned probe does the same without those weights.
"""

from __future__ import annotations

import torch

from splitllm.lab.privacy.states import PublicModel, StageStack
from splitllm.model.visibility import Visibility


@torch.inference_mode()
def whitebox_next_tokens(model: PublicModel, last: StageStack, states: torch.Tensor) -> torch.Tensor:
    """(n_windows, length) greedy tokens from (n_windows, length, d) states through the public last stage."""
    n, length = states.shape[:2]
    positions, vis = torch.arange(length), Visibility.chain(length)
    out = torch.empty(n, length, dtype=torch.long)
    for i in range(n):
        hidden = states[i].to(model.dtype)
        if last.stages:
            hidden = last.forward(last.new_caches(length), hidden, positions, vis, [])[last.cuts[-1]]
        out[i] = model.logits(hidden).argmax(-1)
    return out
