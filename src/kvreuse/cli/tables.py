"""Tables for people: as wide as the terminal (or ``COLUMNS``), and never a cut number.

rich shrinks every column evenly when a table is wider than the console, which turns
``1,636,900`` into ``1,636,…``. Here numbers never shrink: text columns (labels, URLs) wrap
instead, and when even that cannot fit, each row is printed as a block of ``name value`` pairs
that wraps between pairs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import TextIO

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

PIPE_WIDTH = 120
"""Width for output that is not a terminal and has no ``COLUMNS``: logs and CI read wide."""

MIN_TEXT_WIDTH = 12
"""A text column narrower than this reads worse than the one-block-per-row layout."""


def console_width(file: TextIO | None = None) -> int | None:
    """``COLUMNS`` when set to a positive integer; else the terminal's width (``None``: rich
    asks the terminal); else :data:`PIPE_WIDTH` for a pipe or a file."""
    text = os.environ.get("COLUMNS", "").strip()
    if text.isdigit() and int(text) > 0:
        return int(text)
    stream = file if file is not None else sys.stdout
    isatty = getattr(stream, "isatty", None)
    return None if isatty is not None and isatty() else PIPE_WIDTH


def make_console(*, stderr: bool = False) -> Console:
    """The console of a command: stdout (or stderr), width as :func:`console_width` says."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(file=stream, width=console_width(stream), stderr=stderr)


def _header_width(header: str) -> int:
    return max(len(line) for line in header.split("\n"))


def print_table(
    console: Console,
    title: str,
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    text_columns: Sequence[int] = (0,),
) -> None:
    """Print ``rows`` under ``headers`` (``\\n`` breaks a header). Columns in ``text_columns``
    are left-aligned and wrap; the others are right-aligned and keep their full width. When the
    console is too narrow for that, every row becomes one block instead (see the module
    docstring). O(cells)."""
    number_widths = [
        max([_header_width(h)] + [len(r[i]) for r in rows])
        for i, h in enumerate(headers)
        if i not in text_columns
    ]
    text_minimum = len(text_columns) * MIN_TEXT_WIDTH
    # one column of padding per column, plus the table's two edges
    needed = sum(number_widths) + text_minimum + len(headers) + 2
    if needed > console.width:
        _print_blocks(console, title, headers, rows, text_columns)
        return
    table = Table(
        title=Text(title), box=box.SIMPLE_HEAD, padding=(0, 0, 0, 1), title_justify="left"
    )
    for i, header in enumerate(headers):
        if i in text_columns:
            table.add_column(header, overflow="fold", min_width=MIN_TEXT_WIDTH)
        else:
            table.add_column(header, justify="right", no_wrap=True)
    for row in rows:
        # Text, not markup: a label like exact[spill_threshold_s=0.1] is no style tag.
        table.add_row(*(Text(cell) for cell in row))
    console.print(table)


def _print_blocks(
    console: Console,
    title: str,
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    text_columns: Sequence[int],
) -> None:
    width = max(console.width, 20)
    console.print(Text(title), overflow="fold")
    names = [" ".join(h.split()) for h in headers]
    for row in rows:
        heading = " ".join(row[i] for i in text_columns)
        console.print(heading, overflow="fold", markup=False, highlight=False)
        pairs = [f"{names[i]} {row[i]}" for i in range(len(row)) if i not in text_columns]
        line = " "
        for pair in pairs:
            candidate = f"{line}  {pair}" if line.strip() else f"  {pair}"
            if len(candidate) > width and line.strip():
                console.print(line, markup=False, highlight=False, overflow="fold")
                line = f"  {pair}"
            else:
                line = candidate
        if line.strip():
            console.print(line, markup=False, highlight=False, overflow="fold")
