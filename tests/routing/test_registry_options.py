"""build_policy refuses options of the wrong type with a readable ConfigError."""

from __future__ import annotations

import math

import pytest

from kvreuse.errors import ConfigError
from kvreuse.routing import build_policy


@pytest.mark.parametrize(("policy", "options"), [
    ("relative_spill", {"slack": "abc"}),
    ("relative_spill", {"slack": "nan"}),
    ("cache_aware", {"spill_threshold_s": "abc"}),
    ("dynamo_kv", {"router_temperature": "nan"}),
    ("llm_d", {"kv_capacity_tokens": 1.5}),
    ("dynamo_kv", {"block_size": True}),
    ("relative_spill", {"estimator": 3}),
])
def test_wrong_option_types_are_configuration_errors(policy: str,
                                                     options: dict[str, object]) -> None:
    """Text for a number, a fraction for an integer, a boolean for a number: ConfigError
    naming the option."""
    with pytest.raises(ConfigError, match=next(iter(options))):
        build_policy(policy, **options)


def test_well_typed_options_still_build() -> None:
    """Integers pass for floats, None where the option allows it, inf for a slack."""
    spill = build_policy("relative_spill", slack=math.inf, tree_capacity_tokens=None)
    assert spill.slack == math.inf  # type: ignore[attr-defined]
    aware = build_policy("cache_aware", spill_threshold_s=1)
    assert aware.spill_threshold_s == 1  # type: ignore[attr-defined]
    assert build_policy("prefix_hash", overload=None) is not None
