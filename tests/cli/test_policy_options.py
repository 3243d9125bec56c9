"""`route --policy-option`, `simulate --policy-option` and `simulate --policy NAME[k=v]` read
options the same way."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvreuse.cli.args import key_value, option_value, policy_spec, split_policies
from kvreuse.cli.main import build_parser
from kvreuse.cli.route import build_config
from kvreuse.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "value"),
    [("0.2", 0.2), ("512", 512), ("null", None), ("None", None), ("inf", math.inf),
     ("true", True), ('"in_flight"', "in_flight"), ("in_flight", "in_flight")],
)
def test_values_read_as_json_or_as_labels_print_them(text: str, value: object) -> None:
    """JSON, the words the run labels print (None, inf, True), else the text itself."""
    assert option_value(text) == value


@pytest.mark.parametrize("text", ["[" * 5000 + "]" * 5000, "1" * 5000])
def test_a_value_json_cannot_hold_is_kept_as_text(text: str) -> None:
    """Nesting too deep or an integer too long for Python's json is the text itself (the
    policy then says the option is wrong), not a RecursionError or ValueError."""
    assert option_value(text) == text


def test_route_and_simulate_agree() -> None:
    """The gateway's options from --policy-option equal simulate's from brackets."""
    args = build_parser().parse_args([
        "route", "--upstream", "http://127.0.0.1:9", "--policy", "prefix_hash",
        "--policy-option", "overload=None", "--policy-option", "k=512",
    ])
    assert build_config(args).policy_options == {"overload": None, "k": 512}
    assert policy_spec("prefix_hash[overload=None,k=512]") == (
        "prefix_hash", {"overload": None, "k": 512}
    )


def test_route_defaults_to_relative_spill(tmp_path: Path) -> None:
    """Without --policy (or a config file naming one) the gateway routes with relative_spill,
    and a config file's policy still wins over the default."""
    args = build_parser().parse_args(["route", "--upstream", "http://127.0.0.1:9"])
    assert build_config(args).policy == "relative_spill"
    config = tmp_path / "gateway.toml"
    config.write_text('[gateway]\npolicy = "cache_aware"\n\n'
                      '[[upstreams]]\nurl = "http://127.0.0.1:9"\n')
    args = build_parser().parse_args(["route", "--config", str(config)])
    assert build_config(args).policy == "cache_aware"


def test_policies_split_outside_brackets() -> None:
    """Commas inside a policy's brackets separate options, not policies."""
    assert split_policies("round_robin, prefix_hash[overload=2,k=64],exact") == [
        "round_robin", "prefix_hash[overload=2,k=64]", "exact"
    ]


@pytest.mark.parametrize("text", ["overload", "=3", "prefix_hash[overload=2"])
def test_malformed_options_name_the_flag(text: str) -> None:
    """KEY=VALUE without a key or a value sign, or an unclosed bracket: ConfigError."""
    with pytest.raises(ConfigError):
        if "[" in text:
            policy_spec(text)
        else:
            key_value(text, "--policy-option")
