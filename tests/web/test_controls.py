"""Lab controls: strict parsing of JSON bodies and query strings."""

from __future__ import annotations

from typing import Any

import pytest

from kvreuse.errors import InputFormatError
from kvreuse.web.controls import ControlChoices, LabControls, parse_controls, parse_query

CHOICES = ControlChoices(
    scenarios=("belgavi", "mission-2"),
    routing=("round_robin", "cache_aware"),
    scheduling=("fcfs", "lpm"),
    missions=("mission-1",),
)


def test_absent_fields_keep_the_base_values() -> None:
    """Only the fields given change; the rest come from the base controls."""
    base = LabControls(replicas=4, seed=9)
    parsed = parse_controls({"routing": "cache_aware"}, CHOICES, base)
    assert parsed.routing == "cache_aware"
    assert (parsed.replicas, parsed.seed) == (4, 9)


def test_integral_floats_are_accepted_as_counts() -> None:
    """JSON numbers like 3.0 are whole numbers; JavaScript sends them that way."""
    assert parse_controls({"replicas": 3.0}, CHOICES).replicas == 3


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"replicas": 0}, "replicas"),
        ({"replicas": 2.5}, "replicas"),
        ({"replicas": True}, "replicas"),
        ({"replicas": "3"}, "replicas"),
        ({"cache_tokens": -1}, "cache_tokens"),
        ({"arrival_rate": 0}, "arrival_rate"),
        ({"arrival_rate": float("nan")}, "arrival_rate"),
        ({"spill_threshold_s": -0.1}, "spill_threshold_s"),
        ({"duration_s": 10_000}, "duration_s"),
        ({"routing": "fastest"}, "routing"),
        ({"scheduling": 1}, "scheduling"),
        ({"scenario": "nope"}, "scenario"),
        ({"cache_enabled": "yes"}, "cache_enabled"),
        ({"mission": "mission-9"}, "mission"),
        ({"seed": -1}, "seed"),
        ({"replica": 3}, "replica"),
    ],
)
def test_bad_values_name_their_field(body: dict[str, Any], field: str) -> None:
    """Every bad value raises InputFormatError whose ``where`` is the offending field."""
    with pytest.raises(InputFormatError) as info:
        parse_controls(body, CHOICES)
    assert info.value.where == field
    assert field in str(info.value)


def test_a_non_object_body_is_rejected() -> None:
    """A JSON list is not a set of controls."""
    with pytest.raises(InputFormatError) as info:
        parse_controls([1, 2], CHOICES)
    assert info.value.where == "body"


def test_unknown_field_message_lists_the_controls() -> None:
    """The error for a misspelt field says which names exist."""
    with pytest.raises(InputFormatError, match="routing"):
        parse_controls({"polcy": "x"}, CHOICES)


def test_query_strings_convert_numbers_and_booleans() -> None:
    """Text values from a URL become the same typed controls as a JSON body."""
    parsed = parse_query(
        {
            "replicas": "3",
            "arrival_rate": "12.5",
            "cache_enabled": "false",
            "routing": "cache_aware",
        },
        CHOICES,
    )
    assert parsed == LabControls(
        replicas=3, arrival_rate=12.5, cache_enabled=False, routing="cache_aware"
    )


def test_query_string_rejects_non_numbers() -> None:
    """``replicas=three`` names the field."""
    with pytest.raises(InputFormatError) as info:
        parse_query({"replicas": "three"}, CHOICES)
    assert info.value.where == "replicas"


def test_cache_gib_uses_128_kib_per_token() -> None:
    """8,192 tokens at 128 KiB each are exactly 1 GiB."""
    assert LabControls(cache_tokens=8192).cache_gib == pytest.approx(1.0)
