"""What `splitllm drafter train` runs for a model unless told otherwise.

A model's recipe is sized to finish from nothing (an empty work folder) within about an hour on a
2-core CPU with two threads: answering and training time grow with the model, so the larger model
answers fewer conversations. docs/results/drafting-log.md has each recipe's measured time and acceptance.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace

from splitllm.weights.packaged import DEFAULT_MODEL


@dataclass(frozen=True)
class Recipe:
    """The settings that size a training run (the rest default alike for every model)."""

    prompts: int  # conversations the target answers
    epochs: int
    generate_batch: int  # conversations answered together
    weights: str  # how the drafter's matrices are stored: float16 or int8
    intermediate: int | None = None  # the drafter's MLP width (None: the target's)

    def given(self, **options: int | str | None) -> Recipe:
        """This recipe with the options a user gave (None: not given) in place of its own."""
        return replace(self, **{k: v for k, v in options.items() if v is not None})

    def continuing(self) -> Recipe:
        """The recipe for a drafter continued from a trained one: that drafter's width, so none of its own."""
        return replace(self, intermediate=None)

    def as_options(self, keys: Iterable[str]) -> list[str]:
        """The command-line options that ask for these settings of this recipe (a None asks for nothing)."""
        values = asdict(self)
        return [arg for key in keys if values[key] is not None for arg in (f"--{key.replace('_', '-')}",
                                                                           str(values[key]))]


# For a model without a recipe of its own: small enough for a first try on a model up to a few
# hundred million parameters.
GENERIC = Recipe(prompts=480, epochs=6, generate_batch=64, weights="int8")

RECIPES = {
    # Fits the hour; the shipped default-model drafter (its runs: docs/results/drafting-log.md).
    DEFAULT_MODEL: Recipe(prompts=3600, epochs=2, generate_batch=64, weights="int8"),
    # What fits the hour on this host's slower days; more conversations ran well over it there (timings:
    # docs/results/drafting-log.md). A full layer of the 1.5B is 52 M parameters: the MLP is narrowed to
    # 2048 of 8960.
    "qwen2.5-coder-1.5b": Recipe(prompts=900, epochs=2, generate_batch=64, weights="int8", intermediate=2048),
}


def recipe_for(model: str | None) -> Recipe:
    """The recipe of a packaged model's alias (None: the default model); GENERIC for anything else."""
    return RECIPES.get(model or DEFAULT_MODEL, GENERIC)
