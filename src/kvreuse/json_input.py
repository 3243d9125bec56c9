"""JSON from outside (files, HTTP bodies), parsed so that every malformed input is one
:class:`~kvreuse.errors.InputFormatError` saying what is wrong and where.

The standard library alone fails in ways a user cannot read: bytes that are not UTF-8 raise
``UnicodeDecodeError``, a lone surrogate (``"\\ud800"``) parses and then breaks whatever encodes
the string later, nesting a few thousand deep raises ``RecursionError``, an integer of 5,000
digits raises a bare ``ValueError`` (or, below Python's limit, costs quadratic time), and
``NaN``/``Infinity``/``1e999`` slip through as non-finite floats. :func:`parse_json` turns each of
these into an error naming the place (file and line, or the field path).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from kvreuse.errors import InputFormatError

MAX_DEPTH = 64
"""Deepest nesting of arrays and objects accepted by default (request bodies nest a handful)."""
MAX_INT_DIGITS = 100
"""Longest integer accepted by default, in digits (a 64-bit integer has 20)."""

_SURROGATE = re.compile("[\ud800-\udfff]")


class _NumberError(Exception):
    """Raised from the parser's number hooks; carries the message."""


def _place(where: str | None, detail: str | None = None) -> str | None:
    if detail is None:
        return where
    return f"{where}: {detail}" if where else detail


def utf8_text(data: bytes, where: str | None, what: str = "UTF-8") -> str:
    """``data`` decoded, or :class:`InputFormatError` ``not valid {what}`` naming the first bad
    byte and its value. O(len(data))."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputFormatError(
            f"not valid {what}: byte {exc.start} is 0x{data[exc.start]:02x}", where
        ) from None


def parse_json(
    data: bytes | str,
    where: str | None = None,
    *,
    max_depth: int = MAX_DEPTH,
    max_int_digits: int = MAX_INT_DIGITS,
    allow_non_finite: bool = False,
) -> Any:
    """The value ``data`` holds. Raises :class:`InputFormatError` (``where`` names the source:
    a file, ``file:line``, ``body``) for bytes that are not UTF-8, text that is not JSON (with
    line and column), nesting deeper than ``max_depth``, an integer longer than
    ``max_int_digits``, a non-finite number (``NaN``, ``Infinity``, ``1e999``) and a string or
    key holding a lone surrogate (with its field path). ``allow_non_finite`` lets ``NaN``,
    ``Infinity`` and overflowing floats through as Python's json reads them (the gateway
    forwards what vLLM accepts). O(len(data))."""
    text = utf8_text(bytes(data), where) if isinstance(data, bytes | bytearray) else data
    if text.startswith("\ufeff"):
        text = text[1:]

    def integer(digits: str) -> int:
        if len(digits.lstrip("-")) > max_int_digits:
            raise _NumberError(
                f"an integer of {len(digits.lstrip('-')):,} digits; at most "
                f"{max_int_digits} are accepted"
            )
        return int(digits)

    def real(digits: str) -> float:
        value = float(digits)
        if not math.isfinite(value):
            raise _NumberError(f"the number {digits[:40]} is out of range")
        return value

    def constant(name: str) -> Any:
        raise _NumberError(f"{name} is not a JSON number")

    try:
        if allow_non_finite:
            value = json.loads(text, parse_int=integer)
        else:
            value = json.loads(text, parse_int=integer, parse_float=real,
                               parse_constant=constant)
    except json.JSONDecodeError as exc:
        raise InputFormatError(
            f"not valid JSON (line {exc.lineno}, column {exc.colno}): {exc.msg}", where
        ) from None
    except _NumberError as exc:
        raise InputFormatError(f"not accepted: {exc}", where) from None
    except RecursionError:
        raise InputFormatError(
            f"nested too deeply (more than {max_depth} levels of arrays and objects)", where
        ) from None
    check_value(value, where, max_depth=max_depth)
    return value


def check_value(value: Any, where: str | None = None, *, max_depth: int = MAX_DEPTH) -> None:
    """Raise :class:`InputFormatError` if ``value`` (parsed JSON) nests deeper than
    ``max_depth`` or holds a lone surrogate in a string or key; the message names the field
    path. Iterative, O(nodes)."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                raise InputFormatError(
                    "a string holds a lone UTF-16 surrogate (not valid Unicode)",
                    _place(where, path or "(the value)"),
                )
            continue
        if not isinstance(node, dict | list):
            continue
        if depth >= max_depth:
            raise InputFormatError(
                f"nested too deeply (more than {max_depth} levels of arrays and objects)",
                _place(where, path or None),
            )
        if isinstance(node, dict):
            for key, item in node.items():
                child = f"{path}.{key}" if path else str(key)
                if _SURROGATE.search(key):
                    raise InputFormatError(
                        "a key holds a lone UTF-16 surrogate (not valid Unicode)",
                        _place(where, path or "(the value)"),
                    )
                stack.append((item, child, depth + 1))
        else:
            for index, item in enumerate(node):
                stack.append((item, f"{path}[{index}]", depth + 1))
