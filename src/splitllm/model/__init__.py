"""The decoder math both sides run: config, layers, stages with their KV caches, visibility, precision,
the kernel stage, and a model's ends (embedding, final norm, LM head)."""
