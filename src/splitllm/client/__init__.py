"""The trusted side: tokenizer, embedding, first and last stages, LM head, and the server connection."""
