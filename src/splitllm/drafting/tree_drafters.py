"""The drafters one generation drafts with, built from what the client holds: a draft model's proposer
first, then the learned drafter's."""

from __future__ import annotations

from splitllm.decoding.proposers import TreeDrafter
from splitllm.decoding.sizing.calibration import CalibrationConfig
from splitllm.drafting.draft_model_proposer import DraftModelProposer
from splitllm.drafting.drafter_proposer import DrafterProposer, DraftingClient


class TreeDrafters:
    """Makes each generation's drafters, their trees `top_k` wide over `beam` frontier nodes. A draft
    model's proposer is kept from one generation to the next while it fits (its cache holds the history
    so far, which a conversation's next turn continues); a learned drafter's is new each time."""

    def __init__(self, top_k: int, beam: int, calibration: CalibrationConfig) -> None:
        self.top_k, self.beam, self.calibration = top_k, beam, calibration
        self.draft_model_proposer: DraftModelProposer | None = None

    @property
    def nbytes(self) -> int:
        """Client memory the kept draft model proposer's cache holds."""
        return self.draft_model_proposer.cache.nbytes if self.draft_model_proposer is not None else 0

    def for_generation(self, client_model: DraftingClient, max_context: int) -> list[TreeDrafter]:
        drafters: list[TreeDrafter] = []
        if client_model.draft_model is not None:
            kept = self.draft_model_proposer
            if kept is None or kept.model is not client_model.draft_model or kept.cache.max_context < max_context:
                kept = DraftModelProposer(client_model.draft_model, max_context, self.top_k, self.beam,
                                          self.calibration)
                self.draft_model_proposer = kept
            drafters.append(kept)
        if client_model.drafter is not None:
            drafters.append(DrafterProposer(client_model.drafter, client_model, max_context, self.top_k, self.beam,
                                            self.calibration))
        return drafters
