"""The terminal tables (the doctor's checks, the plan's bytes per rank, the comparison of runs): one renderer.

tabulate's ``simple`` format: a header, a dashed rule under each column, one line per row, columns two spaces
apart, cells as given (no number parsing: a cell is printed as its caller formatted it), no trailing spaces.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence


def render(header: Sequence[str], rows: Iterable[Sequence[Any]], *, align: Sequence[str] | None = None) -> str:
    """The table as plain text; ``align``: "left" or "right" per column (default: all left); None cells are empty."""
    # deferred: start-up (tabulate loads wcwidth, tens of ms; __main__ imports report, and a config error prints no table)
    from tabulate import tabulate

    cells = [["" if c is None else str(c) for c in row] for row in rows]
    text = tabulate(cells, headers=list(header), tablefmt="simple", disable_numparse=True,
                    colalign=tuple(align) if align else None)
    return "\n".join(line.rstrip() for line in text.splitlines())
