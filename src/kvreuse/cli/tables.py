"""Tables for people: as wide as the terminal (or ``COLUMNS``), and never a cut number.

rich shrinks every column evenly when a table is wider than the console, which turns
``1,636,900`` into ``1,636,…``. Here no cell is ever cut or split: when the whole table does not
fit, each row is printed as a block instead, its label on one line and its ``name value``
pairs wrapped between pairs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import TextIO

from rich import box
from rich.console import Console, Group, RenderableType
from rich.measure import Measurement
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

PIPE_WIDTH = 120
"""Width for output that is not a terminal and has no ``COLUMNS``: logs and CI read wide."""


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


COUNT = "{task.completed}/{task.total}"
"""How far a :func:`progress_bar` is, in whole units (cells, requests)."""

BYTES = "bytes"
"""A :func:`progress_bar` over bytes read: ``12.3/45.6 MB``."""


def progress_bar(console: Console | None, *, counted: str = COUNT, disable: bool = False
                 ) -> Progress:
    """The progress bar of a long command: what it is doing, a bar, how far it is (``counted``:
    :data:`COUNT`, :data:`BYTES`, or a rich format of ``task``) and the time taken. Transient:
    it is gone once the command prints its results. It draws nothing without a ``console`` or
    on one that is not a terminal: a pipe or a log cannot redraw a line, and rich would still
    leave an empty line there when the bar stops."""
    amount: ProgressColumn = DownloadColumn() if counted == BYTES else TextColumn(counted)
    quiet = disable or console is None or not console.is_terminal
    return Progress(TextColumn("{task.description}"), BarColumn(), amount, TimeElapsedColumn(),
                    console=console, transient=True, disable=quiet)


def print_table(
    console: Console,
    title: str,
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    text_columns: Sequence[int] = (0,),
) -> None:
    """Print :func:`table_renderable` of the arguments."""
    console.print(table_renderable(console, title, headers, rows, text_columns=text_columns))


def table_renderable(
    console: Console,
    title: str,
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    text_columns: Sequence[int] = (0,),
) -> RenderableType:
    """``rows`` under ``headers`` (``\\n`` breaks a header) as ``console`` can show them.
    Columns in ``text_columns`` are left-aligned, the others right-aligned; every cell keeps
    its full width. When the console is too narrow for that, every row becomes one block
    instead: its first column on a line, the other cells as ``name value`` pairs wrapped
    between pairs. O(cells)."""
    # The title goes on its own line: as a table title rich would wrap it to the table's width.
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 0), show_edge=False)
    for i, header in enumerate(headers):
        if i in text_columns:
            table.add_column(header, no_wrap=True)
        else:
            table.add_column(header, justify="right", no_wrap=True)
    for row in rows:
        # Text, not markup: a label like exact[spill_threshold_s=0.1] is no style tag.
        table.add_row(*(Text(cell) for cell in row))
    # measured unbounded: rich clamps a measurement to the console, hiding the overflow
    natural = Measurement.get(console, console.options.update_width(1 << 20), table).maximum
    if natural <= console.width:
        return Group(Text(title, overflow="fold"), table)
    return Group(*_blocks(console.width, title, headers, rows))


def _blocks(
    width: int, title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]
) -> list[Text]:
    lines = [Text(title, overflow="fold")]
    names = [" ".join(h.split()) for h in headers]
    for row in rows:
        lines.append(Text(row[0], overflow="fold"))
        line = ""
        for name, cell in zip(names[1:], row[1:], strict=True):
            if not cell:
                continue
            pair = f"{name} {cell}"
            if line and len(line) + 2 + len(pair) > width:
                lines.append(Text(line, overflow="fold"))
                line = ""
            line = f"{line}  {pair}" if line else f"  {pair}"
        if line:
            lines.append(Text(line, overflow="fold"))
    return lines
