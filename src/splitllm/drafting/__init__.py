"""The proposers that draft with a model on the client: the learned drafter (`Drafter`, EAGLE-style, over the
client's own top-layer features), a whole smaller draft model (`DraftModel`), the trees they grow, and the
drafters shipped under `drafters/<model>/`."""
