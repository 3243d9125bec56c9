"""fast_init: a cheaper __init__ that keeps every frozen-dataclass behaviour."""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass, field

import pytest

from kvreuse.frozen import fast_init


@fast_init
@dataclass(frozen=True, slots=True)
class Point:
    x: int
    y: int
    label: str = "p"
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class PlainPoint:
    x: int
    y: int
    label: str = "p"
    weight: float = 1.0


@fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    name: str
    size: int = 3
    tags: tuple[str, ...] = ()


def test_fields_defaults_and_keywords_are_set() -> None:
    """Positional, keyword and default arguments land in the right fields."""
    point = Point(1, y=2, weight=0.5)
    assert (point.x, point.y, point.label, point.weight) == (1, 2, "p", 0.5)
    assert type(point) is Point


def test_instances_stay_frozen() -> None:
    """Assigning or deleting a field still raises FrozenInstanceError."""
    point = Point(1, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        point.x = 5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del point.y  # type: ignore[misc]


def test_equality_hash_and_repr_match_a_plain_frozen_dataclass() -> None:
    """__eq__, __hash__ and __repr__ are the dataclass's own."""
    assert Point(1, 2) == Point(1, 2) != Point(2, 1)
    assert hash(Point(1, 2, "a")) == hash(Point(1, 2, "a"))
    assert repr(Point(1, 2)) == repr(PlainPoint(1, 2)).replace("PlainPoint", "Point")


def test_wrong_arguments_raise_type_error() -> None:
    """Missing, extra or unknown arguments are refused like the generated __init__ does."""
    with pytest.raises(TypeError):
        Point(1)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Point(1, 2, "a", 1.0, "extra")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Point(1, 2, colour="red")  # type: ignore[call-arg]


def test_keyword_only_fields_stay_keyword_only() -> None:
    """kw_only dataclasses keep refusing positional arguments."""
    assert Options(name="a").size == 3
    with pytest.raises(TypeError):
        Options("a")  # type: ignore[misc]


def test_pickle_and_replace_round_trip() -> None:
    """Pickling and dataclasses.replace give equal instances of the class."""
    point = Point(3, 4, "q")
    assert pickle.loads(pickle.dumps(point)) == point
    moved = dataclasses.replace(point, x=9)
    assert moved == Point(9, 4, "q") and type(moved) is Point


def test_subclass_falls_back_to_the_original_init() -> None:
    """A subclass (whose layout may differ) is built by the dataclass's own __init__."""

    @dataclass(frozen=True, slots=True)
    class Heavy(Point):
        mass: int = 0

    heavy = Heavy(1, 2, mass=7)
    assert (heavy.x, heavy.mass) == (1, 7) and type(heavy) is Heavy
    plain = PlainPoint.__init__
    assert Point.__init__ is not plain


@fast_init
@dataclass(frozen=True, slots=True)
class Pair:
    a: int
    b: str = "b"


def test_small_classes_get_the_setter_form_with_the_same_behaviour() -> None:
    """A two-field class (per-slot setters) keeps defaults, freezing, equality, pickling."""
    pair = Pair(1)
    assert (pair.a, pair.b) == (1, "b") and type(pair) is Pair
    assert "_set_a" in Pair.__init__.__code__.co_names + Pair.__init__.__code__.co_freevars
    with pytest.raises(dataclasses.FrozenInstanceError):
        pair.a = 2  # type: ignore[misc]
    assert pair == Pair(1, "b") != Pair(1, "c") and hash(pair) == hash(Pair(1))
    assert pickle.loads(pickle.dumps(pair)) == pair
    assert dataclasses.replace(pair, b="z") == Pair(1, "z")
    with pytest.raises(TypeError):
        Pair()  # type: ignore[call-arg]


def test_classes_without_fields_are_left_alone() -> None:
    """Nothing to store: the generated __init__ is kept."""

    @dataclass(frozen=True, slots=True)
    class Empty:
        pass

    original = Empty.__init__
    assert fast_init(Empty).__init__ is original


def test_refuses_classes_it_cannot_handle() -> None:
    """Non-frozen, unslotted, InitVar and default_factory classes are refused."""

    @dataclass(slots=True)
    class Mutable:
        a: int
        b: int
        c: int

    @dataclass(frozen=True)
    class Unslotted:
        a: int
        b: int
        c: int

    @dataclass(frozen=True, slots=True)
    class Checked:
        a: int
        b: int
        c: int
        scale: dataclasses.InitVar[int] = 1

        def __post_init__(self, scale: int) -> None:
            pass

    @dataclass(frozen=True, slots=True)
    class Factory:
        a: int
        b: int
        c: list[int] = field(default_factory=list)

    for cls in (Mutable, Unslotted, Checked, Factory):
        with pytest.raises(TypeError, match=cls.__name__):
            fast_init(cls)


@fast_init
@dataclass(frozen=True, slots=True)
class Derived:
    a: int
    b: int
    c: int
    d: int = 0
    total: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", self.a + self.b + self.c + self.d)


@fast_init
@dataclass(frozen=True, slots=True)
class DerivedPair:
    a: int
    doubled: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "doubled", 2 * self.a)


def test_post_init_runs_last_and_sets_init_false_fields() -> None:
    """__post_init__ runs after the fields are set, on the frozen class, in both forms."""
    item = Derived(1, 2, 3, d=4)
    assert (item.total, type(item)) == (10, Derived)
    assert DerivedPair(5).doubled == 10
    with pytest.raises(dataclasses.FrozenInstanceError):
        item.total = 0  # type: ignore[misc]
    assert dataclasses.replace(item, a=11).total == 20
    assert pickle.loads(pickle.dumps(item)) == item


def test_init_false_field_with_a_default_is_refused() -> None:
    """An init=False field with a default (set by the dataclass's own __init__) is refused."""

    @dataclass(frozen=True, slots=True)
    class Defaulted:
        a: int
        b: int = field(init=False, default=0)

    with pytest.raises(TypeError, match="Defaulted"):
        fast_init(Defaulted)
