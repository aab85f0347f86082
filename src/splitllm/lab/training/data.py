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
distribution at every position (`features`), so any text teaches the target's behaviour.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from splitllm.client.local import LocalModel
from splitllm.kv import KVCache
from splitllm.model.stage import Stage
from splitllm.model.weights import ModelFiles
from splitllm.lab.data import corpus
from splitllm.visibility import Visibility

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
LANGUAGES = ("Python", "JavaScript", "Go", "Rust", "C", "Java")
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
)
EVAL_NGRAM = 8  # a training sequence sharing any 8-gram of tokens with an evaluation prompt is dropped


def _topic_names() -> list[str]:
    """Language Reference topics of the corpus' training documents (its test documents stay unseen)."""
    return [d.name.split(":", 1)[1] for d in corpus.reference_documents() if d.kind == "prose" and not d.test]


def build_prompts(n: int, seed: int = 0) -> list[str]:
    """n distinct prompts from the templates, cycling through them so every kind is represented."""
    rng = random.Random(seed)
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        text, fill = _TEMPLATES[len(out) % len(_TEMPLATES)]
        prompt = text.format(**fill(rng))
        if prompt not in seen or len(seen) > 50 * n:
            seen.add(prompt)
            out.append(prompt)
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


def generate_answers(
    files: ModelFiles,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    max_new_tokens: int,
    batch: int = 32,
    progress: Callable[[int], None] | None = None,
) -> list[list[int]]:
    """prompt + the target's greedy answer (float32, unsplit model) for every prompt, as token ids."""
    model = AutoModelForCausalLM.from_pretrained(files.path, dtype=torch.float32).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch):
        ids = [chat_ids(tokenizer, p) for p in prompts[i : i + batch]]
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        with torch.inference_mode():
            gen = model.generate(
                input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                pad_token_id=pad,
            )
        for x, row in zip(ids, gen[:, width:].tolist()):
            end = next((j + 1 for j, t in enumerate(row) if t in eos_ids), len(row))
            out.append(x + row[:end])
        if progress:
            progress(len(ids))
    return out


@dataclass
class Features:
    """Per sequence: token ids (T,) and the target's top-layer features (T, d) before the final norm."""

    ids: list[torch.Tensor]
    features: list[torch.Tensor]

    @property
    def tokens(self) -> int:
        return sum(int(x.numel()) for x in self.ids)


class Extractor:
    """Our own decoder over all layers: the features the split client's tail hands the drafter."""

    def __init__(self, files: ModelFiles) -> None:
        self.stage = Stage.load(files, 0, files.config.num_layers, torch.float32)
        self.embed = LocalModel(files, 1, 0).embed  # the client's embedding, scaled where the family scales it

    def __call__(self, sequence: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor(list(sequence), dtype=torch.long)
        n = ids.numel()
        cache: KVCache = self.stage.new_cache(n)
        return self.stage(cache, self.embed(ids), torch.arange(n), Visibility.chain(n), []).clone()


def features(
    files: ModelFiles, sequences: Sequence[Sequence[int]], progress: Callable[[int], None] | None = None
) -> Features:
    """Token ids and features of every sequence."""
    extract = Extractor(files)
    feats = []
    for seq in sequences:
        feats.append(extract(seq))
        if progress:
            progress(1)
    return Features([torch.tensor(list(s), dtype=torch.long) for s in sequences], feats)


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
