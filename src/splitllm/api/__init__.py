"""Ways in for existing tools: an OpenAI-compatible endpoint and a transformers-style model class."""
