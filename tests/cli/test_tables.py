"""kvreuse.cli.tables: every cell whole, whatever the width; COLUMNS and pipes honoured."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from kvreuse.cli.tables import BYTES, COUNT, PIPE_WIDTH, console_width, print_table, progress_bar

HEADERS = ("run", "token\nhit", "evicted\ntokens")
ROWS = [["exact[spill_threshold_s=0.05] x4", "69.9%", "1,636,900"],
        ["round_robin (no_cache) x7", "0.0%", "0"]]


def _render(width: int) -> str:
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None)
    print_table(console, "a title that is longer than the table itself", HEADERS, ROWS)
    return out.getvalue()


@pytest.mark.parametrize("width", [40, 60, 100])
def test_no_cell_is_cut_at_any_width(width: int) -> None:
    """Wide enough: one table row per run; too narrow: one block per run; never an ellipsis."""
    text = _render(width)
    assert "…" not in text
    for row in ROWS:
        line = next(i for i, line in enumerate(text.splitlines()) if row[0] in line)
        block = " ".join(text.splitlines()[line: line + 3])
        assert all(cell in block for cell in row[1:]), (width, block)


def test_a_label_wider_than_the_console_folds_whole() -> None:
    """At 20 columns a 32-character label folds onto a second line; nothing is dropped."""
    text = "".join(_render(20).split())
    assert "…" not in text
    for row in ROWS:
        assert all("".join(cell.split()) in text for cell in row)


def test_a_wide_console_gets_a_table_with_the_title_on_its_own_line() -> None:
    """At 100 columns: the title first, unwrapped, then headers and one line per run."""
    lines = _render(100).splitlines()
    assert lines[0].strip() == "a title that is longer than the table itself"
    assert any(line.startswith("exact[spill_threshold_s=0.05] x4") and "1,636,900" in line
               for line in lines)


def test_columns_wins_and_pipes_read_wide(monkeypatch: pytest.MonkeyPatch) -> None:
    """COLUMNS sets the width; without it a pipe or file gets PIPE_WIDTH."""
    monkeypatch.setenv("COLUMNS", "87")
    assert console_width(io.StringIO()) == 87
    monkeypatch.delenv("COLUMNS")
    assert console_width(io.StringIO()) == PIPE_WIDTH
    monkeypatch.setenv("COLUMNS", "wide")
    assert console_width(io.StringIO()) == PIPE_WIDTH


def _drawn(counted: str, total: int, done: int) -> str:
    out = io.StringIO()
    console = Console(file=out, width=100, color_system=None, force_terminal=True)
    with progress_bar(console, counted=counted) as progress:
        task = progress.add_task("merging", total=total)
        progress.update(task, completed=done)
        progress.refresh()
    return out.getvalue()


def test_a_progress_bar_shows_what_it_does_and_how_far_in_units() -> None:
    """COUNT: the description and ``done/total`` in whole units."""
    text = _drawn(COUNT, 40, 12)
    assert "merging" in text and "12/40" in text


def test_a_progress_bar_over_bytes_shows_sizes() -> None:
    """BYTES: ``done/total`` as sizes, not a count of bytes."""
    text = _drawn(BYTES, 45_600_000, 12_300_000)
    assert "12.3/45.6 MB" in text and "12300000" not in text


def test_a_progress_bar_without_a_console_draws_nothing() -> None:
    """No console (a replay driven by a library caller): the bar is disabled."""
    with progress_bar(None) as progress:
        assert progress.disable


def test_a_progress_bar_into_a_pipe_writes_not_even_a_newline() -> None:
    """A console that is not a terminal (a pipe, a log) gets no bar and no stray empty line."""
    out = io.StringIO()
    with progress_bar(Console(file=out, width=100)) as progress:
        progress.update(progress.add_task("merging", total=3), advance=1)
    assert out.getvalue() == ""
