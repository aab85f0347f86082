"""Training data for a drafter, built offline: the target's own answers plus licensed text.

Two sources, both chat-templated the way the client sends prompts:
- self-distillation: conversations from `lab.data.instructions` (requests of many kinds, some with a
  follow-up turn) answered greedily by the target model itself, so the drafter sees the target's own
  style of text;
- text: running prose of the Python Language Reference and standard-library sources (the privacy
  corpus' training documents only; its test documents stay unseen), as assistant turns.
Every sequence is checked against every evaluation prompt of this project by shared token n-grams;
a sequence that shares one is dropped, and the check's result goes into the drafter's metadata.
Labels are never the text's tokens: training reads the target's features and its next-token
distribution at every position (`capture`), so any text teaches the target's behaviour.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from splitllm.lab.data import corpus
from splitllm.weights.sources import ModelFiles

EVAL_NGRAM = 8  # a training sequence sharing any 8-gram of tokens with an evaluation prompt is dropped


def chat_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of a conversation as the client sends it: with the assistant's prompt after a user turn,
    closed after an assistant turn."""
    open_turn = messages[-1]["role"] == "user"
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=open_turn)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def turn(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def text_sequences(tokenizer: PreTrainedTokenizerBase, n: int, length: int) -> list[list[int]]:
    """n chat-templated passages of about `length` tokens from the corpus' training documents."""
    docs = [d for d in corpus.reference_documents() if not d.test]
    prose = [d for d in docs if d.kind == "prose" and len(d.text) > 400]
    code = [d for d in docs if d.kind == "code"]
    out: list[list[int]] = []
    chars = length * 4
    for i in range(n):
        pool = code if i % 3 == 0 else prose
        doc = pool[(i * 7) % len(pool)]
        start = (i * 7919) % max(len(doc.text) - chars, 1)
        passage = doc.text[start : start + chars]
        name = doc.name.split(":", 1)[1]
        question = (
            f"Explain the Python topic '{name}'."
            if doc.kind == "prose"
            else f"Show code from the Python module {name}."
        )
        out.append(chat_ids(tokenizer, [turn("user", question), turn("assistant", passage)])[: length + 48])
    return out


@dataclass
class Features:
    """Per sequence: token ids (T,) and the target's features (T, (len(taps) + 1) d): the outputs of the
    tapped layers, then the top layer's before the final norm."""

    ids: list[torch.Tensor]
    features: list[torch.Tensor]
    taps: tuple[int, ...] = ()

    @property
    def tokens(self) -> int:
        return sum(int(x.numel()) for x in self.ids)


def evaluation_prompts(tokenizer: PreTrainedTokenizerBase) -> dict[str, list[list[int]]]:
    """Token ids of every prompt this project evaluates on: benchmark workload, demo, privacy test windows."""
    from splitllm.lab.data.workload import DEMO_PROMPT, workload

    texts = [p.text for p in workload()] + [DEMO_PROMPT]
    return {
        "benchmark and demo prompts": [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts],
        "privacy corpus test windows": corpus.build_corpus(tokenizer).test.tolist(),
    }


def _ngrams(seq: Sequence[int], n: int) -> set[tuple[int, ...]]:
    return {tuple(seq[i : i + n]) for i in range(len(seq) - n + 1)}


def longest_shared(train: Iterable[Sequence[int]], evaluation: Iterable[Sequence[int]], limit: int = 64) -> int:
    """Length of the longest token n-gram (up to `limit`) found both in training and evaluation data."""
    train, evaluation = list(train), list(evaluation)
    best = 0
    for n in range(1, limit + 1):
        grams: set[tuple[int, ...]] = set().union(*(_ngrams(e, n) for e in evaluation))
        if not any(not grams.isdisjoint(_ngrams(s, n)) for s in train):
            break
        best = n
    return best


def drop_overlapping(
    sequences: list[list[int]], evaluation: dict[str, list[list[int]]], n: int = EVAL_NGRAM
) -> tuple[list[list[int]], dict]:
    """Drop sequences sharing an n-gram with any evaluation prompt; the check's report for the metadata."""
    grams: set[tuple[int, ...]] = set().union(*(_ngrams(e, n) for seqs in evaluation.values() for e in seqs))
    kept = [s for s in sequences if grams.isdisjoint(_ngrams(s, n))]
    report = {
        "ngram": n,
        "sequences_dropped": len(sequences) - len(kept),
        "longest_shared_ngram_after_drop": {name: longest_shared(kept, seqs, n) for name, seqs in evaluation.items()},
        "evaluation_sets": {name: len(seqs) for name, seqs in evaluation.items()},
    }
    return kept, report


def load_tokenizer(files: ModelFiles) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(files.path)
