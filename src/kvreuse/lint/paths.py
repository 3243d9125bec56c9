"""Field paths inside a request (``messages[0].content``, ``tools[3].function.parameters``).

Comparison here is *order-sensitive*: two tool schemas with the same keys in a different order
are equal Python dicts but serialise to different bytes, and so to different tokens.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PathKey = str | int
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True, slots=True)
class FieldPath:
    """A location in a JSON request. ``tail`` marks a list whose items from ``keys[-1]`` on
    differ in number as well as content (replacing it means replacing the rest of the list)."""

    keys: tuple[PathKey, ...]
    tail: bool = False

    def __str__(self) -> str:
        return format_path(self.keys)


def format_path(keys: Sequence[PathKey]) -> str:
    """``("messages", 0, "content")`` -> ``messages[0].content``."""
    out = ""
    for key in keys:
        if isinstance(key, int):
            out += f"[{key}]"
        elif _IDENTIFIER.match(key):
            out += f".{key}" if out else key
        else:
            out += f"[{key!r}]"
    return out or "(request)"


def differing_paths(a: object, b: object, *, max_depth: int = 12) -> Iterator[FieldPath]:
    """The deepest paths where ``a`` and ``b`` differ, in document order (order-sensitive)."""
    yield from _walk(a, b, (), max_depth)


def _walk(a: object, b: object, keys: tuple[PathKey, ...], depth: int) -> Iterator[FieldPath]:
    if _same(a, b):
        return
    if depth <= 0:
        yield FieldPath(keys)
        return
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if list(a.keys()) != list(b.keys()):
            # Key order or key set differs: the object itself is what changed.
            yield FieldPath(keys)
            return
        for key in a:
            yield from _walk(a[key], b[key], (*keys, str(key)), depth - 1)
        return
    if _is_list(a) and _is_list(b):
        assert isinstance(a, Sequence) and isinstance(b, Sequence)
        if len(a) == len(b):
            for index, (item_a, item_b) in enumerate(zip(a, b, strict=True)):
                yield from _walk(item_a, item_b, (*keys, index), depth - 1)
            return
        first = next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if not _same(x, y)),
            min(len(a), len(b)),
        )
        yield FieldPath((*keys, first), tail=True)
        return
    yield FieldPath(keys)


def _is_list(value: object) -> bool:
    return isinstance(value, list | tuple)


def _same(a: object, b: object) -> bool:
    """Equal *and* equally ordered (dict equality ignores key order; serialisation does not)."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return list(a.keys()) == list(b.keys()) and all(_same(a[k], b[k]) for k in a)
    if _is_list(a) and _is_list(b):
        assert isinstance(a, Sequence) and isinstance(b, Sequence)
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def get_path(value: object, keys: Sequence[PathKey]) -> Any:
    """The value at ``keys``; raises KeyError/IndexError when absent."""
    for key in keys:
        value = value[key]  # type: ignore[index]
    return value


def splice(base: Any, other: Any, path: FieldPath) -> Any:
    """A deep copy of ``base`` with the value at ``path`` taken from ``other``."""
    result = copy.deepcopy(base)
    if not path.keys:
        return copy.deepcopy(other)
    parent_keys, last = path.keys[:-1], path.keys[-1]
    target = get_path(result, parent_keys)
    source = get_path(other, parent_keys)
    if path.tail:
        assert isinstance(last, int), "a tail path ends in a list index"
        target[last:] = copy.deepcopy(list(source[last:]))
    else:
        target[last] = copy.deepcopy(source[last])
    return result


def string_leaves(value: object, keys: tuple[PathKey, ...] = ()) -> Iterator[tuple[str, str]]:
    """Every string inside ``value`` with its formatted path, in document order."""
    if isinstance(value, str):
        yield format_path(keys), value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from string_leaves(item, (*keys, str(key)))
    elif _is_list(value):
        assert isinstance(value, Sequence)
        for index, item in enumerate(value):
            yield from string_leaves(item, (*keys, index))


def path_containing(request: Mapping[str, Any], snippet: str) -> str | None:
    """The first string field of ``request`` that contains ``snippet``; None if only the
    template could have produced it."""
    for path, text in string_leaves(request):
        if snippet in text:
            return path
    return None


def common_prefix_chars(a: str, b: str) -> int:
    """Length of the common prefix of two strings. O(n) in C, O(log n) Python steps."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
