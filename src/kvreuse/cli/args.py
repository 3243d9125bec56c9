"""Argument types shared by CLI commands: errors name the flag's rule, argparse names the flag."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvreuse.errors import ConfigError, InputFormatError
from kvreuse.json_input import parse_json


def _whole_number(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _whole_number(text, 1)


def port_number(text: str) -> int:
    """A TCP port, 0 to 65535 (0: any free port)."""
    value = _whole_number(text, 0)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port, 0 to 65535, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """A finite float >= 0."""
    value = _finite(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


_WORDS: dict[str, Any] = {
    "none": None, "null": None, "true": True, "false": False,
    "inf": math.inf, "infinity": math.inf,
}


def option_value(text: str) -> Any:
    """A policy option's value as ``route`` and ``simulate`` read it: JSON (``0.2``, ``null``,
    ``"in_flight"``), the words the run labels print (``None``, ``True``, ``False``, ``inf``),
    else the text itself (``in_flight``)."""
    stripped = text.strip()
    if stripped.lower() in _WORDS:
        return _WORDS[stripped.lower()]
    try:
        return parse_json(stripped, allow_non_finite=True)
    except InputFormatError:  # not JSON, or JSON too deep or with too long an integer
        return stripped


def key_value(text: str, flag: str) -> tuple[str, Any]:
    """``KEY=VALUE`` into ``(KEY, option_value(VALUE))``; a malformed item names ``flag``."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"{flag} expects KEY=VALUE, got {text!r}")
    return key.strip(), option_value(value)


def policy_spec(text: str) -> tuple[str, dict[str, Any]]:
    """``name`` or ``name[key=value,...]`` (the form run labels print, e.g.
    ``prefix_hash[overload=None]``) into the name and its options. O(len(text))."""
    text = text.strip()
    if "[" not in text:
        return text, {}
    name, _, rest = text.partition("[")
    if not rest.endswith("]"):
        raise ConfigError(
            f"--policy {text!r}: options go in brackets, e.g. prefix_hash[overload=None]"
        )
    options: dict[str, Any] = {}
    for item in rest[:-1].split(","):
        if item.strip():
            key, value = key_value(item, f"--policy {name}[...]")
            options[key] = value
    return name.strip(), options


def split_policies(text: str) -> list[str]:
    """Split ``--policy a,b[x=1,y=2],c`` on the commas outside brackets."""
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def input_file(path_text: str, what: str) -> Path:
    """``path_text`` as a readable regular file, else a :class:`ConfigError` saying which
    (``what`` names the flag or argument, e.g. ``--config``) and why: missing, a directory, or
    not a regular file."""
    path = Path(path_text)
    if path.is_dir():
        raise ConfigError(f"{what} {path_text}: is a directory; give a file")
    if not path.exists():
        raise ConfigError(f"{what} {path_text}: no such file")
    if not path.is_file():
        raise ConfigError(f"{what} {path_text}: not a regular file")
    return path


def output_file(path_text: str) -> Path:
    """An argparse type for a file a command will write (``--json``, ``--report``, ``--out``):
    refused at once when its directory is missing or it names a directory, so that a plan or a
    replay of an hour does not fail at its last step. Whether the disk has room is known only
    when writing (:func:`kvreuse.cli.files.write_whole`)."""
    path = Path(path_text)
    if not path_text:
        raise argparse.ArgumentTypeError("an empty path; give a file")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path_text!r} is a directory; give a file")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{path_text}: the directory {path.parent} does not "
                                         "exist")
    return path


def trace_file(path: Path, flag: str) -> Path:
    """``path``, unless it is a directory: what ``kvreuse route --record`` writes, whose files
    are one trace only once ``kvreuse trace merge`` has put them on one clock (the
    :class:`ConfigError` says so)."""
    if path.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory; make its recorded files one trace "
                          f"first: kvreuse trace merge {path} --out trace.jsonl")
    return path


def read_bytes(path_text: str, what: str) -> bytes:
    """The bytes of :func:`input_file` ``path_text``; unreadable files raise
    :class:`ConfigError` naming ``what`` and the reason."""
    path = input_file(path_text, what)
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what} {path_text}: cannot read: {exc.strerror}") from None


def positive_float(text: str) -> float:
    """A finite float > 0."""
    value = _finite(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def speed_list(text: str) -> tuple[float, ...]:
    """``--prefill-speeds``: comma-separated finite numbers > 0."""
    return tuple(positive_float(part) for part in text.split(","))


def speed_change(text: str) -> tuple[float, int, float]:
    """``--speed-change AT:REPLICA:SPEED``: simulated seconds >= 0, a replica's index (``2``
    or ``r2``), its new speed (a finite number > 0)."""
    parts = text.split(":")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(
            f"give AT:REPLICA:SPEED (e.g. 30:r0:0.25, replica r0 at a quarter speed from 30 s "
            f"on), got {text!r}")
    at_s = _finite(parts[0])
    if at_s < 0:
        raise argparse.ArgumentTypeError(f"the time must be >= 0 seconds, got {parts[0]}")
    name = parts[1].strip()
    index = name[1:] if name[:1] in ("r", "R") else name
    if not (index.isascii() and index.isdigit()):
        raise argparse.ArgumentTypeError(
            f"the replica must be an index such as 2 or r2, got {parts[1]!r}")
    return at_s, int(index), positive_float(parts[2])


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return _whole_number(text, 0)


def fraction(text: str) -> float:
    """A float in (0, 1]."""
    value = _finite(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def bounded(parse: Callable[[str], float], high: float) -> Callable[[str], Any]:
    """``parse`` (one of the types above) with an upper bound: sizes past what any machine has
    are typing mistakes, and would overflow the arithmetic downstream."""

    def checked(text: str) -> Any:
        value = parse(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high:,.0f}, got {text}")
        return value

    checked.__name__ = parse.__name__
    return checked
