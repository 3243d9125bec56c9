"""collector_paused: the cyclic collector off for a bulk block, then as it was."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from kvreuse.bulk import collector_paused


@pytest.fixture(autouse=True)
def _restore_collector() -> Iterator[None]:
    was_enabled = gc.isenabled()
    yield
    if was_enabled:
        gc.enable()
    else:
        gc.disable()


def test_paused_inside_and_back_on_after() -> None:
    """The collector is off in the block and on again after it."""
    gc.enable()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_nested_pauses_leave_it_off_until_the_outer_one_ends() -> None:
    """An inner pause does not turn the collector back on inside an outer one."""
    gc.enable()
    with collector_paused():
        with collector_paused():
            pass
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off() -> None:
    """A caller that disabled the collector itself finds it still disabled."""
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()


def test_an_error_in_the_block_still_restores_it() -> None:
    """An exception leaving the block turns the collector back on."""
    gc.enable()
    with pytest.raises(ValueError, match="boom"), collector_paused():
        raise ValueError("boom")
    assert gc.isenabled()


def test_a_trace_error_leaves_the_collector_on() -> None:
    """A trace line the parser refuses (inside its pause) leaves the collector on."""
    from kvreuse.errors import InputFormatError
    from kvreuse.trace import parse_trace_lines

    gc.enable()
    good = '{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}'
    with pytest.raises(InputFormatError):
        parse_trace_lines([good, '{"timestamp": "x"}'], "t.jsonl")
    assert gc.isenabled()
