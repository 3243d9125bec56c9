"""Cheaper construction of hot frozen, slotted dataclasses.

Results and events are frozen, slotted dataclasses (never tuples), and the simulator makes
several per request: a record, decisions, loads, matches, KV events. A frozen dataclass's
generated ``__init__`` sets every field through ``object.__setattr__`` because its own
``__setattr__`` refuses; measured with callgrind on CPython 3.11 that costs about 1,500
instructions per field, against about 300 for a plain slotted class (an 11-field record: ~17k
instructions, about a tenth of a simulated request).

:func:`fast_init` keeps the class and its semantics (frozen, slots, ``__eq__``, ``__hash__``,
``__repr__``, pickling, :func:`dataclasses.replace`) and only replaces ``__init__``, in one of
two forms, whichever is cheaper for the field count (callgrind, per instance):

* four fields or more — the new instance's class is switched, once, to a slot-compatible
  mutable twin (same ``__slots__``, so CPython allows the ``__class__`` assignment), the
  fields are stored with plain attribute writes, and the class is switched back: the two
  switches cost a fixed ~2,900 instructions, each field ~130 (an 11-field record: 17k -> 6k);
* one to three fields — each field is stored through its slot's own descriptor
  (``member.__set__``, bound once), ~700 instructions a field and nothing fixed (two fields:
  4.2k -> 2.8k; three: 4.1k with the twin -> 3.5k).

A ``__post_init__`` runs last, as in the dataclass's own ``__init__``, on the frozen class again:
it sets ``init=False`` fields with ``object.__setattr__``, as it must anyway. Subclasses fall
back to the original ``__init__`` (their layout may differ).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, TypeVar

T = TypeVar("T")

SETTER_MAX_FIELDS = 3
"""Up to this many fields the per-slot setter form is cheaper than the twin class."""


def fast_init(cls: type[T]) -> type[T]:
    """Class decorator, applied *above* ``@dataclass(frozen=True, slots=True)``: returns ``cls``
    with a cheaper ``__init__`` of the same signature. Raises ``TypeError`` for a class it
    cannot handle (not a frozen slotted dataclass, ``default_factory``, an ``init=False`` field
    with a default, ``InitVar``)."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"{cls.__name__}: fast_init needs @dataclass(frozen=True, slots=True)")
    post_init = hasattr(cls, "__post_init__")
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]  # checked just above
    slots = tuple(cls.__dict__["__slots__"])
    if tuple(f.name for f in fields) != slots:
        raise TypeError(f"{cls.__name__}: fast_init needs exactly one slot per field")
    init_names = [f.name for f in fields if f.init]
    if list(inspect.signature(cls.__init__).parameters)[1:] != init_names:
        raise TypeError(f"{cls.__name__}: fast_init takes no InitVar (its __init__ takes more "
                        f"than its fields)")
    if not fields:
        return cls
    namespace: dict[str, Any] = {}
    positional: list[str] = []
    keyword: list[str] = []
    for f in fields:
        if f.default_factory is not dataclasses.MISSING or (
            not f.init and f.default is not dataclasses.MISSING
        ):
            raise TypeError(f"{cls.__name__}.{f.name}: fast_init takes plain fields only")
        if not f.init:
            continue  # __post_init__ sets it
        param = f.name
        if f.default is not dataclasses.MISSING:
            namespace[f"_default_{f.name}"] = f.default
            param = f"{f.name}=_default_{f.name}"
        (keyword if f.kw_only else positional).append(param)
    signature = ", ".join(["self", *positional, *(["*", *keyword] if keyword else [])])
    names = init_names
    forward = ", ".join(f"{n}={n}" for n in names)
    if not names:
        body, prologue, epilogue = "        pass", "", ""
    elif len(names) <= SETTER_MAX_FIELDS:
        for n in names:
            namespace[f"_set_{n}"] = cls.__dict__[n].__set__
        body = "\n".join(f"        _set_{n}(self, {n})" for n in names)
        prologue, epilogue = "", ""
    else:
        body = "\n".join(f"        self.{n} = {n}" for n in names)
        prologue = "        _osa(self, '__class__', _twin)\n"
        epilogue = "        self.__class__ = _cls\n"
    source = (
        f"def make(_cls, _twin, _osa, _original, {', '.join(namespace)}):\n"
        f"    def __init__({signature}):\n"
        f"        if type(self) is not _cls:\n"
        f"            return _original(self, {forward})\n"
        f"{prologue}"
        f"{body}\n"
        f"{epilogue}"
        f"{'        self.__post_init__()' if post_init else ''}\n"
        f"    return __init__\n"
    )
    twin = type(f"_{cls.__name__}Twin", (), {"__slots__": slots, "__module__": cls.__module__})
    scope: dict[str, Any] = {}
    exec(source, {}, scope)
    init = scope["make"](cls, twin, object.__setattr__, cls.__init__, **namespace)
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__doc__ = cls.__init__.__doc__
    cls.__init__ = init  # type: ignore[method-assign]
    return cls
