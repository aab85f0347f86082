"""Decoders: turn a prompt into committed tokens, one round trip per step (`proposers/`: the n-gram
candidates; `sizing/`: how big each step is)."""
