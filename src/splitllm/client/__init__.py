"""The trusted side: tokenizer, embedding, head and tail layers, LM head, and the server connection."""
