"""What people ask a chat model, built offline: instructions for the drafter's self-distillation.

Families of templates over word lists cover conversation (explanation, advice, facts, comparison,
creative writing, role play, reasoning with numbers, rewriting, planning, letters, definitions) and code
(implementing, explaining, debugging, testing, translating, data formats, shell and SQL) in a dozen
languages; passages of the Python standard library's documentation and sources (the privacy corpus'
training documents only) give rewriting, extraction and code-reading tasks real input. A share of
conversations gets a second user turn ("now make it shorter", "add type hints") answered in context.

Each pool has a held-out part that no training prompt draws from, so a drafter can be compared with
another on subjects and tasks neither has seen (`held_out`). No pool names a subject of the benchmark
workload or the demo (checked by `tests/test_draft_train.py` besides the n-gram check on all data).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

from splitllm.lab.data import corpus

KINDS = ("conversation", "code")


@dataclass(frozen=True)
class Instruction:
    """One conversation to answer: its user turns in order (the later ones follow the model's answers)."""

    turns: tuple[str, ...]
    kind: str  # one of KINDS


@dataclass(frozen=True)
class Pools:
    """The word lists templates draw from (training's or the held-out ones)."""

    subjects: Sequence[str]
    tasks: Sequence[str]
    activities: Sequence[str]
    concepts: Sequence[str]
    shared: bool  # whether families that draw nothing from these pools (library passages, fixed lists) take part


SUBJECTS = (
    "volcanoes", "honey bees", "the printing press", "glaciers", "coral reefs", "the Roman aqueducts",
    "electric cars", "sourdough bread", "chess openings", "migrating birds", "solar panels", "jazz music",
    "the human heart", "rainforests", "submarines", "origami", "the moon landing", "coffee roasting",
    "earthquakes", "recycling plastic", "the immune system", "desert plants", "wind turbines", "penguins",
    "ancient Egypt", "photosynthesis", "the internet", "bicycles", "hurricanes", "fermentation",
    "the Great Wall", "octopuses", "public libraries", "batteries", "mountain climbing", "the violin",
    "composting", "satellites", "dinosaurs", "saving money", "team sports", "public speaking", "board games",
    "bird watching", "running a marathon", "knitting", "home cooking", "time management", "the Olympic Games",
    "vaccines", "the stock market", "renewable energy", "the Renaissance", "bees and pollination",
    "credit scores", "3D printing", "the water cycle", "sleep and dreams", "electric guitars", "microplastics",
    "the Silk Road", "artificial intelligence", "bridges", "tides", "the French Revolution", "cheese making",
    "rock climbing", "podcasts", "minimalism", "tornadoes", "the periodic table", "wolves", "elephants",
    "the Amazon river", "vinyl records", "skateboarding", "opera", "cryptography", "the Vikings",
    "urban gardening", "meditation", "inflation", "the Industrial Revolution", "bamboo", "sharks",
    "hot air balloons", "chocolate", "the Pyramids of Giza", "video games", "yoga", "wildfires",
    "the metric system", "lightning", "antibiotics", "classical music", "the Eiffel Tower", "spiders",
    "nuclear power", "carpentry", "street food", "the Beatles", "recycling glass", "typewriters",
    "the Arctic", "mushrooms", "photography", "tennis", "the Moon's phases", "handwriting",
)
TASKS = (
    "reverses the words of a sentence", "counts the vowels in a string", "merges two sorted lists",
    "returns the n-th Fibonacci number", "removes duplicates from a list while keeping the order",
    "checks whether a number is prime", "flattens a nested list", "computes the factorial of n",
    "finds the largest element of a list without using max", "converts Celsius to Fahrenheit",
    "groups words by their first letter", "counts how often each word appears in a text",
    "validates that a string looks like an email address", "rotates a list by k positions",
    "computes the greatest common divisor of two integers", "transposes a matrix given as nested lists",
    "parses a date string in the form YYYY-MM-DD", "returns the second smallest number of a list",
    "checks whether two strings are anagrams", "sums the digits of an integer",
    "writes a dictionary to a JSON file", "finds all pairs of numbers in a list that add up to a target",
    "capitalizes every word of a title", "computes the median of a list of numbers",
    "converts a Roman numeral to an integer", "checks whether parentheses in a string are balanced",
    "returns the longest word of a sentence", "chunks a list into pieces of size n",
    "computes the running average of a stream of numbers", "converts an integer to its binary representation",
    "finds the most common element of a list", "removes all whitespace from a string",
    "merges two dictionaries, summing values of shared keys", "generates all permutations of a string",
    "computes the dot product of two vectors", "checks whether a year is a leap year",
    "splits a full name into first and last name", "counts the words in a file",
    "returns every prime number below n", "finds the intersection of two lists",
    "truncates a string to n characters with an ellipsis", "computes compound interest",
    "converts a snake_case name to camelCase", "validates a password's strength",
    "shuffles a list in place", "formats a number of seconds as hours, minutes and seconds",
    "finds the missing number in a list of 1 to n", "encodes a string with a Caesar cipher",
    "deep-copies a nested dictionary", "retries a function call up to three times",
    "computes the Levenshtein distance of two strings", "sorts a list of dictionaries by one key",
    "builds a frequency histogram of characters", "returns the k largest numbers of a list",
    "checks whether a linked list has a cycle", "implements a least-recently-used cache",
    "computes the area of a polygon from its vertices", "parses query parameters from a URL",
)
LANGUAGES = ("Python", "JavaScript", "TypeScript", "Go", "Rust", "C", "C++", "Java", "Ruby", "Kotlin", "C#", "Swift")
ACTIVITIES = (
    "sleep better", "write a cover letter", "prepare for a job interview", "start running", "keep a journal",
    "plan a birthday party", "learn to cook rice", "organize my desk", "ask for a raise", "read more books",
    "make friends in a new city", "study for an exam", "reduce screen time", "fix a squeaky door",
    "save for a holiday", "train a puppy", "give feedback to a colleague", "choose a laptop",
    "stop procrastinating", "negotiate the price of a used car", "start a small business", "learn to swim",
    "write a wedding toast", "deal with a noisy neighbour", "stay focused while working from home",
    "pick a good password", "make a budget", "learn to draw", "cook for a large group", "clean an oven",
    "prepare for a long hike", "talk to my kids about money", "get over a cold faster", "paint a room",
    "start a vegetable garden on a balcony", "write a good resume", "calm down before an exam",
    "choose a first guitar", "build a reading habit", "moderate a meeting", "write a thank-you note",
)
CONCEPTS = (
    "recursion", "closures", "generators", "async and await", "hash maps", "big-O notation", "unit testing",
    "version control with git", "REST APIs", "SQL joins", "regular expressions", "memoization",
    "dependency injection", "race conditions", "garbage collection", "type hints", "pointers", "immutability",
    "event loops", "caching", "object-oriented inheritance", "functional programming", "Docker containers",
    "binary trees", "dynamic programming", "the difference between a process and a thread", "exceptions",
    "decorators", "interfaces", "environment variables",
)
ROLES = (
    "a friendly librarian", "a pirate captain", "a museum guide", "a personal trainer", "a medieval knight",
    "a chef in a busy kitchen", "a park ranger", "a detective", "a tour guide in Rome", "a wise old wizard",
    "a customer support agent", "a sports commentator", "a science teacher", "a travel agent", "a gardener",
)
AUDIENCES = ("a ten-year-old", "my grandmother", "a new colleague", "a busy manager", "a high-school student")
TONES = ("formal", "friendly", "funny", "persuasive", "very concise", "enthusiastic")
PLACES = (
    "Lisbon", "Kyoto", "Iceland", "New York", "the Scottish Highlands", "Vienna", "Mexico City", "Cape Town",
    "Berlin", "Vancouver", "Istanbul", "Buenos Aires", "Seoul", "Prague", "Sydney", "Morocco",
)
SENTENCES = (
    "hey, can u send me the report by tmrw? thx", "The meeting got moved, no idea why, its now at 3.",
    "our product is good and people like it and it is cheap", "I cant come to the party because I am sick.",
    "The results was not what we expected but we learned alot.", "pls fix the bug asap, customers are angry",
    "The train was late so I missed the start of the show.", "we need more money for the project or it fails",
    "I think maybe we should possibly consider changing the plan.", "the new app is confusing and slow",
    "Thanks for the gift, it was really nice of you.", "Sorry for the late reply, I was on holiday.",
    "the weather ruined our picnic but the cake was great", "Due to reasons, the shop closes early today.",
    "he said the code works but it doesnt on my machine", "Our team won the match after a hard season.",
)
FOLLOW_UPS = {
    "conversation": (
        "Now make it shorter.", "Can you explain that more simply?", "Turn that into a bulleted list.",
        "Give me a concrete example.", "Rewrite it in a more formal tone.", "Summarize your answer in one sentence.",
        "What are the downsides?", "Thanks! Can you add one more tip?", "Make it funnier.",
        "Which point matters most, and why?", "Now write it as a short email to a friend.",
        "Can you expand on the second point?", "Is there anything people often get wrong about this?",
    ),
    "code": (
        "Add comments to the code.", "Now write it in {l}.", "How would I test this?", "Can you make it faster?",
        "Add type hints and a docstring.", "Handle invalid input too.", "Explain the code line by line.",
        "What is its time complexity?", "Can you write it without any loops?", "Show an example of calling it.",
    ),
}
# Reserved for held-out comparison: no training prompt draws from these.
HELD_OUT = Pools(
    subjects=(
        "lighthouses of Brittany", "kangaroos", "paper money", "snowflakes", "ice hockey", "the telescope",
        "marathon swimming", "clockmaking", "sea turtles", "the London Underground", "rice farming",
        "fireflies", "the harpsichord", "salt", "sundials", "hiking boots",
    ),
    tasks=(
        "counts the uppercase letters of a string", "reverses a linked list", "checks whether a matrix is symmetric",
        "returns the digits of a number in reverse order", "removes every negative number from a list",
        "finds the longest common prefix of a list of strings", "converts minutes to hours and minutes",
        "computes the average word length of a sentence", "checks whether a list is sorted",
        "returns the first non-repeated character of a string",
    ),
    activities=(
        "learn to juggle", "host a board game night", "repair a bicycle puncture", "memorize a speech",
        "choose running shoes", "write a birthday card", "keep a sourdough starter alive", "sort old photos",
    ),
    concepts=("linked lists", "lazy evaluation", "message queues", "mutexes", "pure functions", "tail calls"),
    shared=False,
)
TRAINING = Pools(SUBJECTS, TASKS, ACTIVITIES, CONCEPTS, shared=True)

_Fill = Callable[[random.Random, Pools], dict[str, str]]


def _s(r: random.Random, p: Pools) -> dict[str, str]:
    return {"s": r.choice(p.subjects)}


def _lt(r: random.Random, p: Pools) -> dict[str, str]:
    return {"l": r.choice(LANGUAGES), "t": r.choice(p.tasks)}


def _a(r: random.Random, p: Pools) -> dict[str, str]:
    return {"a": r.choice(p.activities)}


def _c(r: random.Random, p: Pools) -> dict[str, str]:
    return {"c": r.choice(p.concepts), "l": r.choice(LANGUAGES)}


def _numbers(r: random.Random, _: Pools) -> dict[str, str]:
    a, b, c = r.randint(3, 60), r.randint(2, 30), r.randint(2, 9)
    return {"a": str(a), "b": str(b), "c": str(c), "d": str(a * c), "p": str(r.choice((10, 15, 20, 25, 30)))}


@cache
def _passages(kind: str) -> tuple[tuple[str, str], ...]:
    """(name, excerpt) of the corpus' training documents of one kind: prose paragraphs or source chunks."""
    out = []
    for d in corpus.reference_documents():
        if d.test or d.kind != kind:
            continue
        name = d.name.split(":", 1)[1]
        if kind == "prose":
            out += [(name, p) for p in d.text.split("\n\n") if 200 <= len(p) <= 900]
        else:
            blocks = [b for b in d.text.split("\n\n\n") if b.lstrip().startswith(("def ",
                                                                                  "class ")) and 120 <= len(b) <= 1200]
            out += [(name, b.strip("\n")) for b in blocks]
    return tuple(out)


def _prose(r: random.Random, _: Pools) -> dict[str, str]:
    name, text = r.choice(_passages("prose"))
    return {"k": name, "x": text}


def _source(r: random.Random, _: Pools) -> dict[str, str]:
    name, text = r.choice(_passages("code"))
    return {"m": name, "x": text}


def _both(*fills: _Fill) -> _Fill:
    return lambda r, p: {k: v for f in fills for k, v in f(r, p).items()}


_SHELL = (
    "finds the ten largest files under the current folder", "replaces a word in every .md file",
    "lists the processes using the most memory", "counts unique IP addresses in an access log",
    "archives a folder into a dated tar.gz file", "shows the last 50 lines of a log and follows it",
    "renames every .jpeg file to .jpg", "prints disk usage per subfolder, sorted",
)
_SQL = (
    "products that have never been ordered", "the average salary per department",
    "the number of new users per month in 2023", "employees who earn more than their manager",
    "duplicate email addresses in a users table", "the latest order of every customer",
    "books with more than one author", "delete sessions older than thirty days",
)

_FAMILIES: tuple[tuple[str, str, _Fill, str], ...] = (
    # (kind, template, fill, what it draws from: "pools" (held out in part), "passage" of the library or "fixed" lists)
    ("conversation", "Tell me something interesting about {s}.", _s, "pools"),
    ("conversation", "I'm curious about {s}. How does it work?", _s, "pools"),
    ("conversation", "Give me five quick facts about {s}, as a bulleted list.", _s, "pools"),
    ("conversation", "Compose a limerick about {s}.", _s, "pools"),
    ("conversation", "Tell a bedtime story for children that involves {s}.", _s, "pools"),
    ("conversation", "Summarize the history of {s} in one paragraph.", _s, "pools"),
    ("conversation", "My friend keeps talking about {s}. What should I know before we chat?", _s, "pools"),
    ("conversation", "Compare {s} and {t} in a small table.",
     lambda r, p: dict(zip("st", r.sample(list(p.subjects), 2))), "pools"),
    ("conversation", "Explain {s} to {w}.", lambda r, p: {**_s(r, p), "w": r.choice(AUDIENCES)}, "pools"),
    ("conversation", "What are the pros and cons of {s}?", _s, "pools"),
    ("conversation", "Write a haiku about {s}, then explain the image it uses.", _s, "pools"),
    ("conversation", "Write a {t} product description for something related to {s}.",
     lambda r, p: {**_s(r, p), "t": r.choice(TONES)}, "pools"),
    ("conversation", "Pretend you are {r}. Tell me about {s}.", lambda r, p: {**_s(r, p), "r": r.choice(ROLES)},
     "pools"),
    ("conversation", "You are {r}. A visitor asks how to {a}. Answer in character.",
     lambda r, p: {**_a(r, p), "r": r.choice(ROLES)}, "pools"),
    ("conversation", "Write a short dialogue between {r} and {q} about {s}.",
     lambda r, p: {**_s(r, p), **dict(zip("rq", r.sample(ROLES, 2)))}, "pools"),
    ("conversation", "How do I {a}? Give me practical advice.", _a, "pools"),
    ("conversation", "What are common mistakes people make when they try to {a}?", _a, "pools"),
    ("conversation", "I want to {a} but I keep putting it off. Any tips?", _a, "pools"),
    ("conversation", "Make a three-step plan to {a} this month.", _a, "pools"),
    ("conversation", "Write a short email to a friend about {s}.", _s, "pools"),
    ("conversation", "Write a {t} message to my team announcing a talk about {s}.",
     lambda r, p: {**_s(r, p), "t": r.choice(TONES)}, "pools"),
    ("conversation", "Plan a {c}-day trip to {w} for someone who loves {s}.",
     lambda r, p: {**_s(r, p), "w": r.choice(PLACES), "c": str(r.randint(2, 7))}, "pools"),
    ("conversation", "A shop sells pens at {c} dollars each. I buy {b} pens and pay with a {p}0 dollar note. "
     "How much change do I get? Explain step by step.", _numbers, "fixed"),
    ("conversation", "If a cyclist rides {d} km in {c} hours, what is her average speed? Show your reasoning.",
     _numbers, "fixed"),
    ("conversation", "There are {a} students and each group holds {c}. How many groups are full, and how many "
     "students are left over?", _numbers, "fixed"),
    ("conversation", "A jacket costs {a} dollars and is {p}% off. What is the new price? Explain.", _numbers, "fixed"),
    ("conversation", "Rewrite this to sound {t}: \"{x}\"", lambda r,
     _: {"t": r.choice(TONES), "x": r.choice(SENTENCES)}, "fixed"),
    ("conversation", "Fix the grammar and spelling: \"{x}\"", lambda r, _: {"x": r.choice(SENTENCES)}, "fixed"),
    ("conversation", "Summarize this passage in two sentences:\n\n{x}", _prose, "passage"),
    ("conversation", "List the key terms defined in this text and what each means:\n\n{x}", _prose, "passage"),
    ("conversation", "Rewrite this paragraph in plain words for {w}:\n\n{x}",
     lambda r, p: {**_prose(r, p), "w": r.choice(AUDIENCES)}, "passage"),
    ("conversation", "Write three quiz questions, with answers, about this text:\n\n{x}", _prose, "passage"),
    ("code", "In {l}, implement a function that {t}.", _lt, "pools"),
    ("code", "Show {l} code that {t}, then explain it briefly.", _lt, "pools"),
    ("code", "Write unit tests in {l} for a function that {t}.", _lt, "pools"),
    ("code", "Here is my plan: a {l} function that {t}. What edge cases should it handle?", _lt, "pools"),
    ("code", "Translate a Python function that {t} into {l}.",
     lambda r, p: {"l": r.choice(LANGUAGES[1:]), "t": r.choice(p.tasks)}, "pools"),
    ("code", "My {l} function that {t} gives wrong results for empty input. How should I fix it?", _lt, "pools"),
    ("code", "Give me a one-function {l} solution: a function that {t}. Keep it short.", _lt, "pools"),
    ("code", "Explain {c} with a small {l} example.", _c, "pools"),
    ("code", "When should I use {c}? Show a {l} snippet.", _c, "pools"),
    ("code", "What is the Python module {m} for? Show a short usage example.",
     lambda r, _: {"m": r.choice(corpus.CODE_MODULES)}, "fixed"),
    ("code", "Explain what this Python code does:\n\n```python\n{x}\n```", _source, "passage"),
    ("code", "Add type hints and a docstring to this code from the {m} module:\n\n```python\n{x}\n```", _source,
     "passage"),
    ("code", "Find possible bugs or edge cases in this code:\n\n```python\n{x}\n```", _source, "passage"),
    ("code", "Write a shell command that {t}, using standard Unix tools.",
     lambda r, _: {"t": r.choice(_SHELL)}, "fixed"),
    ("code", "Give me a SQL statement for this: {t}.", lambda r, _: {"t": r.choice(_SQL)}, "fixed"),
    ("code", "Convert this record to {f}: name Ada, born {a}0, languages Python and {l}.",
     lambda r,
     p: {"f": r.choice(("JSON", "YAML", "XML", "a Python dict", "a TOML table")), "a": str(r.randint(180, 199)),
                   "l": r.choice(LANGUAGES)}, "fixed"),
)


def build(n: int, pools: Pools = TRAINING, follow_up_share: float = 0.0, seed: int = 0,
          tries: int = 200) -> list[Instruction]:
    """n distinct conversations, cycling through the families so every kind of request is represented; a
    `follow_up_share` of them gets a second user turn. A family that yields no new prompt in `tries` draws is
    left out from then on."""
    if not 0 <= follow_up_share <= 1:
        raise ValueError("the share of conversations with a follow-up must lie in [0, 1]")
    rng = random.Random(seed)
    live = [f for f in _FAMILIES if pools.shared or f[3] == "pools"]
    out: list[Instruction] = []
    seen: set[str] = set()
    turn = 0
    while len(out) < n:
        if not live:
            raise ValueError(f"the templates make only {len(out)} distinct prompts; ask for fewer than {n}")
        family = live[turn % len(live)]
        kind, text, fill, _ = family
        prompt = next((p for p in (text.format(**fill(rng, pools)) for _ in range(tries)) if p not in seen), None)
        if prompt is None:
            live.remove(family)
            continue
        seen.add(prompt)
        turns: tuple[str, ...] = (prompt,)
        if rng.random() < follow_up_share:
            turns += (rng.choice(FOLLOW_UPS[kind]).format(l=rng.choice(LANGUAGES)),)
        out.append(Instruction(turns, kind))
        turn += 1
    return out


def held_out(n_per_kind: int, follow_up_share: float = 0.3, seed: int = 1) -> dict[str, list[Instruction]]:
    """Conversations per kind from the held-out pools: subjects and tasks no training prompt uses."""
    made = build(n_per_kind * 8, HELD_OUT, follow_up_share, seed)
    return {kind: [i for i in made if i.kind == kind][:n_per_kind] for kind in KINDS}


def describe(instructions: Sequence[Instruction]) -> dict:
    """How many conversations of each kind, and how many with a follow-up turn: for the drafter's metadata."""
    return {
        "by_kind": {k: sum(i.kind == k for i in instructions) for k in KINDS},
        "with_follow_up": sum(len(i.turns) > 1 for i in instructions),
        "template_families": len(_FAMILIES),
    }
