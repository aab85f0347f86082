"""Training data for a drafter, built offline: the target's own answers plus licensed text.

Two sources, both chat-templated the way the client sends prompts:
- self-distillation: prompts made from templates over topic lists (everyday subjects, programming
  tasks, standard-library modules and language topics) answered greedily by the target model itself,
  so the drafter sees the target's own style of text;
- text: running prose of the Python Language Reference and standard-library sources (the privacy
  corpus' training documents only; its test documents stay unseen), as assistant turns.
Every sequence is checked against every evaluation prompt of this project by shared token n-grams;
a sequence that shares one is dropped, and the check's result goes into the drafter's metadata.
Labels are never the text's tokens: training reads the target's features and its next-token
distribution at every position (`capture`), so any text teaches the target's behaviour.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from splitllm.lab.data import corpus
from splitllm.model.weights import ModelFiles

SUBJECTS = (
    "volcanoes", "honey bees", "the printing press", "glaciers", "coral reefs", "the Roman aqueducts",
    "electric cars", "sourdough bread", "chess openings", "migrating birds", "solar panels", "jazz music",
    "the human heart", "rainforests", "submarines", "origami", "the moon landing", "coffee roasting",
    "earthquakes", "recycling plastic", "the immune system", "desert plants", "wind turbines", "penguins",
    "ancient Egypt", "photosynthesis", "the internet", "bicycles", "tea ceremonies", "hurricanes",
    "fermentation", "the Great Wall", "octopuses", "public libraries", "batteries", "mountain climbing",
    "the violin", "composting", "satellites", "dinosaurs", "saving money", "team sports", "public speaking",
    "board games", "bird watching", "running a marathon", "knitting", "home cooking", "time management",
)
CODE_TASKS = (
    "reverses the words of a sentence", "counts the vowels in a string", "merges two sorted lists",
    "returns the n-th Fibonacci number", "removes duplicates from a list while keeping the order",
    "checks whether a number is prime", "flattens a nested list", "computes the factorial of n",
    "finds the largest element of a list without using max", "converts Celsius to Fahrenheit",
    "groups words by their first letter", "counts how often each word appears in a text",
    "validates that a string looks like an email address", "rotates a list by k positions",
    "computes the greatest common divisor of two integers", "transposes a matrix given as nested lists",
    "parses a date string in the form YYYY-MM-DD", "returns the second smallest number of a list",
    "checks whether two strings are anagrams", "sums the digits of an integer",
    "implements a queue with two stacks", "writes a dictionary to a JSON file",
    "finds all pairs of numbers in a list that add up to a target", "capitalizes every word of a title",
)
LANGUAGES = ("Python", "JavaScript", "TypeScript", "Go", "Rust", "C", "C++", "Java", "Ruby", "Kotlin")
ADVICE = (
    "sleep better", "write a cover letter", "prepare for a job interview", "start running", "keep a journal",
    "plan a birthday party", "learn to cook rice", "organize my desk", "ask for a raise", "read more books",
    "make friends in a new city", "study for an exam", "reduce screen time", "fix a squeaky door",
    "save for a holiday", "train a puppy", "give feedback to a colleague", "choose a laptop",
)
_TEMPLATES: tuple[tuple[str, Callable[[random.Random], dict[str, str]]], ...] = (
    ("Tell me something interesting about {s}.", lambda r: {"s": r.choice(SUBJECTS)}),
    ("I'm curious about {s}. How does it work?", lambda r: {"s": r.choice(SUBJECTS)}),
    ("Give me five quick facts about {s}, as a bulleted list.", lambda r: {"s": r.choice(SUBJECTS)}),
    ("Compose a limerick about {s}.", lambda r: {"s": r.choice(SUBJECTS)}),
    ("Tell a bedtime story for children that involves {s}.", lambda r: {"s": r.choice(SUBJECTS)}),
    ("Summarize the history of {s} in one paragraph.", lambda r: {"s": r.choice(SUBJECTS)}),
    ("My friend keeps talking about {s}. What should I know before we chat?", lambda r: {"s": r.choice(SUBJECTS)}),
    ("Compare {s} and {t} in a small table.", lambda r: dict(zip("st", r.sample(SUBJECTS, 2)))),
    ("In {l}, implement a function that {t}.", lambda r: {"l": r.choice(LANGUAGES), "t": r.choice(CODE_TASKS)}),
    ("Show {l} code that {t}, then explain it briefly.", lambda r: {"l": r.choice(LANGUAGES), "t": r.choice(CODE_TASKS)}),
    ("What is the Python module {m} for? Show a short usage example.", lambda r: {"m": r.choice(corpus.CODE_MODULES)}),
    ("Explain the Python language topic '{k}' to a beginner.", lambda r: {"k": r.choice(_topic_names())}),
    ("Write unit tests in {l} for a function that {t}.", lambda r: {"l": r.choice(LANGUAGES), "t": r.choice(CODE_TASKS)}),
    ("Here is my plan: a {l} function that {t}. What edge cases should it handle?",
     lambda r: {"l": r.choice(LANGUAGES), "t": r.choice(CODE_TASKS)}),
    ("Translate a Python function that {t} into {l}.", lambda r: {"l": r.choice(LANGUAGES[1:]), "t": r.choice(CODE_TASKS)}),
    ("How do I {a}? Give me practical advice.", lambda r: {"a": r.choice(ADVICE)}),
    ("Write a short email to a friend about {s}.", lambda r: {"s": r.choice(SUBJECTS)}),
)
EVAL_NGRAM = 8  # a training sequence sharing any 8-gram of tokens with an evaluation prompt is dropped


def _topic_names() -> list[str]:
    """Language Reference topics of the corpus' training documents (its test documents stay unseen)."""
    return [d.name.split(":", 1)[1] for d in corpus.reference_documents() if d.kind == "prose" and not d.test]


def build_prompts(n: int, seed: int = 0, tries: int = 200) -> list[str]:
    """n distinct prompts from the templates, cycling through them so every kind is represented; a template
    that yields no new prompt in `tries` draws is left out from then on."""
    rng = random.Random(seed)
    out: list[str] = []
    seen: set[str] = set()
    live = list(_TEMPLATES)
    turn = 0
    while len(out) < n:
        if not live:
            raise ValueError(f"the templates make only {len(out)} distinct prompts; ask for fewer than {n}")
        text, fill = live[turn % len(live)]
        prompt = next((p for p in (text.format(**fill(rng)) for _ in range(tries)) if p not in seen), None)
        if prompt is None:
            live.remove((text, fill))
            continue
        seen.add(prompt)
        out.append(prompt)
        turn += 1
    return out


def chat_ids(tokenizer: PreTrainedTokenizerBase, user: str, assistant: str | None = None) -> list[int]:
    """Token ids of a chat turn as the client sends it (and the assistant's reply, if given)."""
    messages = [{"role": "user", "content": user}]
    if assistant is None:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = tokenizer.apply_chat_template(
            messages + [{"role": "assistant", "content": assistant}], tokenize=False
        )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


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
        question = f"Explain the Python topic '{name}'." if doc.kind == "prose" else f"Show code from the Python module {name}."
        out.append(chat_ids(tokenizer, question, passage)[: length + 48])
    return out


@dataclass
class Features:
    """Per sequence: token ids (T,) and the target's top-layer features (T, d) before the final norm."""

    ids: list[torch.Tensor]
    features: list[torch.Tensor]

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
