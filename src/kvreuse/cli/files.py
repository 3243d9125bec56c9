"""Files a command writes whole or not at all, and standard streams whose failures are said.

A command killed, interrupted or failing half-way must leave no half a file where a reader (the
next ``simulate``, a resumed ``plan``) would take it for a whole one, nor lose the file it was
replacing. So the text goes to a hidden file beside the target and is renamed over it at the end:
``os.replace`` within one directory is atomic on POSIX.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO, cast

from kvreuse.errors import ConfigError


class CannotWrite(Exception):
    """Opening, writing or renaming the file beside ``target`` failed; ``reason`` is the
    system's word for it (``No space left on device``). Kept apart from ``OSError`` so that a
    caller streaming from a file it reads can tell its input's failures from its output's."""

    def __init__(self, target: Path, reason: str) -> None:
        super().__init__(f"cannot write {target}: {reason}")
        self.target, self.reason = target, reason

    def for_flag(self, flag: str) -> ConfigError:
        """The error to show a user who named the file with ``flag``."""
        return ConfigError(f"{flag} {self.target}: cannot write: {self.reason}")


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
def written_beside(target: Path, *, make_parents: bool = False) -> Iterator[_Sink]:
    """A text sink whose content replaces ``target`` when the block ends without an exception;
    on any exception (the caller's, Ctrl-C, :class:`CannotWrite`) the partial file is removed
    and ``target`` is left as it was. The partial file is ``.NAME.PID.partial`` beside it: a
    directory listing shows whose it is, and two processes never share one.

    A target that exists and is not a regular file (``/dev/stdout``, a named pipe) is written in
    place: it cannot be replaced, and a reader may be waiting on it. A symbolic link stays a
    link: the file it points to is replaced, and keeps its permission bits. ``make_parents``
    creates the directories above ``target`` first; failing that is a :class:`CannotWrite`."""
    try:  # a directory we may not search fails these with EACCES
        if make_parents:
            target.parent.mkdir(parents=True, exist_ok=True)
        destination = target.resolve() if target.is_symlink() else target
        in_place = destination.exists() and not destination.is_file()
    except OSError as exc:
        raise CannotWrite(target, _reason(exc)) from None
    partial = destination if in_place else destination.with_name(
        f".{destination.name}.{os.getpid()}.partial")
    try:
        try:
            file = partial.open("w", encoding="utf-8")
        except OSError as exc:
            raise CannotWrite(target, _reason(exc)) from None
        try:
            yield _Sink(file, target)
            try:
                file.close()  # a full disk often shows first here, flushing the buffer
                if not in_place:
                    if destination.is_file():
                        os.chmod(partial, stat.S_IMODE(destination.stat().st_mode))
                    os.replace(partial, destination)
            except OSError as exc:
                raise CannotWrite(target, _reason(exc)) from None
        finally:
            with contextlib.suppress(OSError):
                file.close()
    finally:
        if not in_place:
            with contextlib.suppress(OSError):  # gone once renamed; a torn one where it failed
                partial.unlink(missing_ok=True)


def write_whole(path: Path, text: str, flag: str) -> None:
    """Write ``text`` to ``path`` through :func:`written_beside`; a failure is a
    :class:`ConfigError` naming ``flag``, and an earlier ``path`` stays as it was."""
    try:
        with written_beside(path) as sink:
            sink.write(text)
    except CannotWrite as exc:
        raise exc.for_flag(flag) from None


class StreamLost(OSError):
    """Standard output or standard error could not be written: a full disk under a redirect, a
    terminal gone. ``main`` says so in one line. Still an ``OSError``, so that the guards
    written for a stream's own failures keep working: ``logging`` drops a record it cannot
    write instead of raising into a server's request."""

    def __init__(self, name: str, error: OSError) -> None:
        super().__init__(error.errno, _reason(error))
        self.name = name

    def __str__(self) -> str:
        return f"cannot write {self.name}: {self.strerror}"


class _ReportingStream:
    """A standard stream whose failed writes raise :class:`StreamLost` naming it. A closed pipe
    (``BrokenPipeError``) passes through unchanged: rich and ``main`` end quietly on it, as
    ``head`` expects. Everything else (``isatty``, ``fileno``, ``encoding``) is the stream's."""

    def __init__(self, stream: TextIO, name: str) -> None:
        self._stream, self._name = stream, name

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise StreamLost(self._name, exc) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise StreamLost(self._name, exc) from None

    def __getattr__(self, attribute: str) -> object:
        return getattr(self._stream, attribute)


@contextlib.contextmanager
def standard_streams_reported() -> Iterator[None]:
    """Within the block, a failed write to ``sys.stdout`` or ``sys.stderr`` raises
    :class:`StreamLost`, and the block ends by flushing stdout, so that a full disk under
    ``> out.txt`` is seen here and not as a traceback when the interpreter exits."""
    stdout, stderr = sys.stdout, sys.stderr
    sys.stdout = cast(TextIO, _ReportingStream(stdout, "standard output"))
    sys.stderr = cast(TextIO, _ReportingStream(stderr, "standard error"))
    try:
        yield
        sys.stdout.flush()
    finally:
        sys.stdout, sys.stderr = stdout, stderr


def discard_standard_output() -> None:
    """Point file descriptor 1 at ``/dev/null``: what stdout still buffers after it failed is
    dropped at exit instead of failing again there ("Exception ignored", exit 120)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
