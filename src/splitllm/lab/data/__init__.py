"""Text the lab's parts share, so their numbers compare and training never sees an evaluation prompt:
the benchmark workload, the privacy corpus and its generated chat and personal-data passages, and the
drafter's training conversations with their held-out word lists."""
