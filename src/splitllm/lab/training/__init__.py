"""`splitllm drafter train`: a drafter for a model from its own answers and features (the drafter itself,
which the client runs, lives in `splitllm.drafting`)."""
