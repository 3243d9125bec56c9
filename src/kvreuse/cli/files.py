"""Files a command writes whole or not at all.

A command killed, interrupted or failing half-way must leave no half a file where a reader (the
next ``simulate``, a resumed ``plan``) would take it for a whole one, nor lose the file it was
replacing. So the text goes to a hidden file beside the target and is renamed over it at the end:
``os.replace`` within one directory is atomic on POSIX.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO


class CannotWrite(Exception):
    """Opening, writing or renaming the file beside ``target`` failed; ``reason`` is the
    system's word for it (``No space left on device``). Kept apart from ``OSError`` so that a
    caller streaming from a file it reads can tell its input's failures from its output's."""

    def __init__(self, target: Path, reason: str) -> None:
        super().__init__(f"cannot write {target}: {reason}")
        self.target, self.reason = target, reason


class _Sink:
    """The partial file, whose :meth:`write` raises :class:`CannotWrite`."""

    def __init__(self, file: TextIO, target: Path) -> None:
        self._file, self._target = file, target

    def write(self, text: str) -> None:
        try:
            self._file.write(text)
        except OSError as exc:
            raise CannotWrite(self._target, _reason(exc)) from None


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


@contextlib.contextmanager
def written_beside(target: Path) -> Iterator[_Sink]:
    """A text sink whose content replaces ``target`` when the block ends without an exception;
    on any exception (the caller's, Ctrl-C, :class:`CannotWrite`) the partial file is removed
    and ``target`` is left as it was. The partial file is ``.NAME.PID.partial`` beside it: a
    directory listing shows whose it is, and two processes never share one."""
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        try:
            file = partial.open("w", encoding="utf-8")
        except OSError as exc:
            raise CannotWrite(target, _reason(exc)) from None
        try:
            yield _Sink(file, target)
            try:
                file.close()  # a full disk often shows first here, flushing the buffer
                os.replace(partial, target)
            except OSError as exc:
                raise CannotWrite(target, _reason(exc)) from None
        finally:
            with contextlib.suppress(OSError):
                file.close()
    finally:
        with contextlib.suppress(OSError):  # gone once renamed; a torn one where it failed
            partial.unlink(missing_ok=True)
