"""`splitllm draft train`: a draft head for a model from its own answers and features (the head itself,
which the client runs, lives in `splitllm.draft`)."""
