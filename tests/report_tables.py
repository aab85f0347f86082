"""Lab reports read back: tests check what a report's table rows say (which columns, which values, in
which order) rather than how they are spelled, so a report can change its spacing or decimals without
its tests. (Committed docs are still compared byte for byte with what renders them: tests/test_published.py.)"""

from __future__ import annotations

import re
from itertools import takewhile

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_BETWEEN_NUMBERS = re.compile(r"[\s/()x%]|\bms\b")  # what a cell of figures shows besides them: 8.0 (0.89x), 3 / 4


def table(text: str, column: str) -> list[dict[str, str]]:
    """The rows of the first Markdown table in `text` with a column named `column`, each keyed by its header."""
    lines = text.splitlines()
    for i, line in enumerate(lines[:-1]):
        header, rule = _cells(line), _cells(lines[i + 1])
        if column in header and rule and all(cell and set(cell) <= set("-:") for cell in rule):
            rows = [_cells(row) for row in takewhile(lambda row: row.startswith("|"), lines[i + 2 :])]
            assert all(len(cells) == len(header) for cells in rows), f"a row's cells are not the columns {header}"
            return [dict(zip(header, cells)) for cells in rows]
    raise AssertionError(f"no table with a column {column!r} in:\n{text}")


def values(row: dict[str, str]) -> dict[str, list[float] | str]:
    """Each cell of a row read back: the numbers of a cell of figures (3 / 4 -> [3, 4], 8.0 (0.89x) -> [8.0, 0.89],
    50.0% -> [50.0]), else its text (a name, even one with a number in it, a flag, '-')."""
    return {column: _figures(cell) or cell for column, cell in row.items()}


def _figures(cell: str) -> list[float]:
    """The numbers of a cell that shows only numbers and their units; none for any other cell."""
    numbers = _NUMBER.findall(cell)
    return [float(n) for n in numbers] if numbers and not _BETWEEN_NUMBERS.sub("", _NUMBER.sub("", cell)) else []


def _cells(line: str) -> list[str]:
    if not line.startswith("|"):
        return []
    return [cell.strip() for cell in line.strip().strip("|").split("|")]
