"""kvreuse.cli.files: a file replaced whole or left as it was, and no partial file either way;
standard streams whose failed writes are named."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from kvreuse.cli.files import (
    CannotWrite,
    StreamLost,
    standard_streams_reported,
    write_whole,
    written_beside,
)
from kvreuse.errors import ConfigError


def _others(directory: Path, target: Path) -> list[Path]:
    return [path for path in directory.iterdir() if path != target]


def test_a_finished_block_replaces_the_target(tmp_path: Path) -> None:
    """The text written replaces the earlier file, and nothing is left beside it."""
    target = tmp_path / "trace.jsonl"
    target.write_text("old\n", encoding="utf-8")
    with written_beside(target) as sink:
        sink.write("new\n")
        assert target.read_text(encoding="utf-8") == "old\n"  # not before the end
    assert target.read_text(encoding="utf-8") == "new\n"
    assert _others(tmp_path, target) == []


def test_an_exception_in_the_block_leaves_the_target_as_it_was(tmp_path: Path) -> None:
    """The caller's error (or Ctrl-C) propagates; the earlier file stays and the partial goes."""
    target = tmp_path / "trace.jsonl"
    target.write_text("old\n", encoding="utf-8")
    with pytest.raises(KeyboardInterrupt), written_beside(target) as sink:
        sink.write("half")
        raise KeyboardInterrupt
    assert target.read_text(encoding="utf-8") == "old\n"
    assert _others(tmp_path, target) == []


def test_a_directory_that_does_not_exist_is_cannot_write(tmp_path: Path) -> None:
    """Opening the partial file fails: CannotWrite names the target and the system's reason."""
    target = tmp_path / "missing" / "trace.jsonl"
    with pytest.raises(CannotWrite) as caught, written_beside(target):
        pass
    assert caught.value.target == target
    assert caught.value.reason == "No such file or directory"


def test_a_rename_that_fails_is_cannot_write_and_leaves_no_partial(tmp_path: Path) -> None:
    """A target that is a directory cannot be replaced by a file: CannotWrite, nothing left."""
    target = tmp_path / "out"
    target.mkdir()
    with pytest.raises(CannotWrite) as caught, written_beside(target) as sink:
        sink.write("x")
    assert caught.value.reason == "Is a directory"
    assert target.is_dir() and _others(tmp_path, target) == []


@pytest.mark.parametrize("writes", [1, 100], ids=["at-the-close", "mid-stream"])
def test_a_write_that_fails_is_cannot_write(tmp_path: Path, writes: int) -> None:
    """A full disk (RLIMIT_FSIZE stands in for it) raises CannotWrite, not OSError, whether it
    shows while writing or only when the buffer is flushed at the end."""
    resource = pytest.importorskip("resource")
    import signal

    target = tmp_path / "big.jsonl"
    previous_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, previous_limit[1]))
    try:
        with pytest.raises(CannotWrite) as caught, written_beside(target) as sink:
            for _ in range(writes):
                sink.write("x" * 5000)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous_limit)
        signal.signal(signal.SIGXFSZ, previous_handler)
    assert caught.value.reason == "File too large"
    assert not target.exists() and _others(tmp_path, target) == []


def test_a_named_pipe_is_written_in_place(tmp_path: Path) -> None:
    """A FIFO (or /dev/stdout) cannot be replaced: its reader gets the text, nothing is left."""
    import os
    import threading

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received: list[str] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text(encoding="utf-8")))
    reader.start()
    write_whole(fifo, "report\n", "--json")
    reader.join(timeout=10)
    assert received == ["report\n"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["pipe"]


def test_write_whole_names_the_flag_the_user_gave(tmp_path: Path) -> None:
    """A failure is a ConfigError saying which flag's file could not be written, and why."""
    with pytest.raises(ConfigError, match=r"^--report .*missing/r.html: cannot write: No such"):
        write_whole(tmp_path / "missing" / "r.html", "<html>", "--report")


def test_a_symbolic_link_stays_a_link_to_the_replaced_file(tmp_path: Path) -> None:
    """The link still points where it did, and the file it names has the new text."""
    (tmp_path / "real").mkdir()
    real = tmp_path / "real" / "report.html"
    real.write_text("old", encoding="utf-8")
    link = tmp_path / "report.html"
    link.symlink_to(real)
    write_whole(link, "new", "--report")
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert real.read_text(encoding="utf-8") == "new"
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["report.html"]


def test_a_replaced_file_keeps_its_permission_bits(tmp_path: Path) -> None:
    """A golden file made group-writable stays so after it is rewritten."""
    golden = tmp_path / "golden.json"
    golden.write_text("{}", encoding="utf-8")
    golden.chmod(0o664)
    write_whole(golden, '{"version": 1}', "--golden")
    assert golden.stat().st_mode & 0o777 == 0o664


class _FullDisk:
    """A stream every write of which fails as on a full disk."""

    def write(self, text: str) -> int:
        raise OSError(28, "No space left on device")

    def flush(self) -> None:
        raise OSError(28, "No space left on device")


def test_a_failed_write_to_stdout_names_the_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """print() to a stdout on a full disk raises StreamLost saying which stream and why."""
    monkeypatch.setattr(sys, "stdout", _FullDisk())
    with pytest.raises(StreamLost, match="cannot write standard output: No space left"), \
            standard_streams_reported():
        print("figures")


def test_a_log_record_stderr_cannot_take_is_dropped_not_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server logging to a stderr gone bad goes on: logging's guard for OSError still takes
    the failure (a StreamLost that were not an OSError would reach the request)."""
    monkeypatch.setattr(sys, "stderr", _FullDisk())
    monkeypatch.setattr(logging, "raiseExceptions", True)
    with standard_streams_reported():
        handler = logging.StreamHandler(sys.stderr)
        logger = logging.getLogger("kvreuse.test.files")
        logger.addHandler(handler)
        try:
            logger.error("upstream gone")
        finally:
            logger.removeHandler(handler)
