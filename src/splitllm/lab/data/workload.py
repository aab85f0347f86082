"""Benchmark prompts in four categories, shared by every benchmark so their numbers compare.

Each category has eight prompts; benchmarks take the first k of each so a short run stays balanced.
"""

from __future__ import annotations

from dataclasses import dataclass

CATEGORIES = ("code", "structured", "creative", "conversational")
DEMO_PROMPT = "Explain in a few sentences why the sky is blue."  # `splitllm demo` asks it unless told otherwise


@dataclass(frozen=True)
class Prompt:
    category: str
    text: str


_PROMPTS: dict[str, tuple[str, ...]] = {
    "code": (
        "Write a Python function that checks whether a string is a palindrome, with a docstring and two examples.",
        "Write a Python class Stack with push, pop, peek and is_empty methods.",
        "Write a JavaScript function that fetches JSON from a URL and logs each item's name.",
        "Write a SQL query that returns the ten customers with the highest total order amount.",
        "Write a Python function that reads a CSV file and returns the average of the 'price' column.",
        "Write a bash script that counts the lines of every .txt file in a folder.",
        "Write a Python function for binary search on a sorted list and explain how it works.",
        "Write an HTML page with a form that asks for a name and an email address.",
    ),
    "structured": (
        "List ten fruits with their typical colors, one per line, as 'fruit: color'.",
        "Give step-by-step instructions for making a cup of tea.",
        "Make a Markdown table of the planets of the solar system with their order from the sun.",
        "List the days of the week and one chore to do on each day.",
        "Write a numbered checklist for preparing a small garden for spring.",
        "Give a weekly workout plan, one line per day, with the exercise and its duration.",
        "List the steps to change a flat tire on a car.",
        "Write a shopping list for a week of simple breakfasts, grouped by store section.",
    ),
    "creative": (
        "Write a short story about a robot who learns to paint.",
        "Write a poem about the ocean at night.",
        "Describe a city on Mars one hundred years from now.",
        "Write a fairy tale about a fox and a clever crow.",
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Write a poem about autumn leaves.",
        "Describe a dragon who is afraid of fire.",
        "Write the opening paragraph of a mystery novel set in a small village.",
    ),
    "conversational": (
        "Hi! Can you recommend a good book for a long train ride?",
        "What is the difference between weather and climate?",
        "Why do cats purr?",
        "How can I get better at waking up early?",
        "What should I pack for a weekend camping trip?",
        "Can you explain what a black hole is in simple terms?",
        "What are some tips for learning a new language?",
        "How do I make my houseplants grow better?",
    ),
}


def workload(per_category: int | None = None, categories: tuple[str, ...] = CATEGORIES) -> list[Prompt]:
    """The first `per_category` prompts of each category (all eight by default), category by category."""
    if per_category is not None and not 1 <= per_category <= 8:
        raise ValueError("prompts per category must be between 1 and 8")
    return [Prompt(c, t) for c in categories for t in _PROMPTS[c][:per_category]]
