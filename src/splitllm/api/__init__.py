"""Ways in for existing tools: an OpenAI-compatible endpoint with the web chat, a transformers-style model
class, and the terminal chat."""
