"""Progress of the one-time work a first run does (joining and converting a model, re-quantizing it,
building the CPU kernels), shown on a terminal's stderr so a long first start never looks hung.

Only on a terminal: logs, pipes and tests see nothing. Never used inside a decoding step, whose time
is measured.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def _shown() -> bool:
    return sys.stderr.isatty()


def tracked(items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
    """`items` one by one, with a bar of how many are done."""
    if not _shown():
        yield from items
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(description, total=total)
        for item in items:
            yield item
            progress.advance(task)


@contextlib.contextmanager
def working(description: str) -> Iterator[None]:
    """A spinner while a block of unknown length runs."""
    if not _shown():
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(description):
        yield
