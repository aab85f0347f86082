"""Attacks an honest-but-curious server can run on the hidden states it is sent or computes."""
