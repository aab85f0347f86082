"""Decoders: turn a prompt into committed tokens, one round trip per step."""
