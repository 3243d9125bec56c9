"""kvreuse.json_input: every malformed input is one InputFormatError saying what and where."""

from __future__ import annotations

import pytest

from kvreuse.errors import InputFormatError
from kvreuse.json_input import parse_json


def test_good_json_parses_as_the_standard_library_does() -> None:
    """Objects, arrays, numbers, unicode text and a BOM-prefixed body parse unchanged."""
    text = '{"a": [1, 2.5, -3e2, "caf\\u00e9", true, null], "b": {"c": "\u4e2d"}}'
    assert parse_json(text) == {"a": [1, 2.5, -300.0, "café", True, None], "b": {"c": "中"}}
    assert parse_json(b"\xef\xbb\xbf[1]") == [1]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b'{"a": "\xc3\x28"}', "not valid UTF-8: byte 7 is 0xc3"),
        ('{"a": {"b": ["\\udc00"]}}', "f.json: a.b[0]: a string holds a lone UTF-16 surrogate"),
        ('{"\\ud800": 1}', "a key holds a lone UTF-16 surrogate"),
        ("[" * 65 + "]" * 65, "nested too deeply (more than 64 levels"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ("1" * 101, "an integer of 101 digits; at most 100"),
        ("-" + "1" * 5000, "an integer of 5,000 digits"),
        ("1e999", "out of range"),
        ('{"x": NaN}', "NaN is not a JSON number"),
        ("[-Infinity]", "-Infinity is not a JSON number"),
        ('{"a": 1,\n "b": }', "not valid JSON (line 2, column 7)"),
    ],
)
def test_malformed_input_names_the_problem(data: bytes | str, message: str) -> None:
    """Each way JSON from outside goes wrong is an InputFormatError with a readable message."""
    with pytest.raises(InputFormatError) as err:
        parse_json(data, "f.json")
    assert message in str(err.value) and str(err.value).startswith("f.json")


def test_limits_are_adjustable() -> None:
    """A caller may allow deeper nesting or longer integers than the defaults."""
    assert parse_json("[" * 100 + "]" * 100, max_depth=100) is not None
    assert parse_json("9" * 200, max_int_digits=200) == int("9" * 200)
    with pytest.raises(InputFormatError):
        parse_json("[[[]]]", max_depth=2)
