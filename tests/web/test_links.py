"""Links into the lab: what `simulate --report` puts next to a run."""

from __future__ import annotations

import math
from urllib.parse import parse_qsl, urlsplit

from kvreuse.web.controls import ControlChoices, LabControls, parse_query
from kvreuse.web.links import lab_query, lab_url, lab_url_for_run

CHOICES = ControlChoices(
    scenarios=("belgavi",),
    routing=("round_robin", "cache_aware"),
    scheduling=("fcfs", "lpm"),
    missions=(),
)


def test_lab_url_round_trips_through_the_query_parser() -> None:
    """The controls a link encodes are exactly the controls the server parses back."""
    controls = LabControls(
        replicas=3, routing="cache_aware", spill_threshold_s=0.25, scheduling="lpm", seed=7
    )
    url = lab_url(controls)
    parts = urlsplit(url)
    assert (parts.scheme, parts.netloc, parts.path) == ("http", "127.0.0.1:8765", "/")
    assert parse_query(dict(parse_qsl(parts.query)), CHOICES) == controls


def test_defaults_are_left_out_of_the_query() -> None:
    """Only what differs from the lab's defaults is in the link, so links stay short."""
    assert lab_query(LabControls()) == ""
    assert lab_query({"replicas": 3, "routing": "round_robin", "mission": None}) == "replicas=3"


def test_booleans_and_integral_floats_are_written_plainly() -> None:
    """``cache_enabled=false`` and ``duration_s=30``, not ``False`` or ``30.0``."""
    query = dict(parse_qsl(lab_query({"cache_enabled": False, "duration_s": 30.0})))
    assert query == {"cache_enabled": "false", "duration_s": "30"}


def test_host_and_port_are_configurable() -> None:
    """A lab started on another port gets links to that port."""
    assert lab_url({"replicas": 2}, port=9000).startswith("http://127.0.0.1:9000/?")


def test_a_simulate_run_links_to_the_same_lab_run() -> None:
    """Mission two's timestamp run opens in the lab with the timestamp at token 200 and the
    same policy, fleet size and seed; the server accepts every key."""
    from kvreuse.web.adapter import SimLab

    url = lab_url_for_run("mission-2", "exact", 6, seed=3, variant="timestamp")
    assert url is not None
    query = dict(parse_qsl(urlsplit(url).query))
    lab = SimLab()
    controls = parse_query(query, lab.choices(), lab.defaults())
    assert (controls.scenario, controls.routing, controls.replicas, controls.seed) == (
        "mission-2",
        "exact",
        6,
        3,
    )
    assert controls.timestamp_at == 200 and controls.cache_enabled
    assert controls.mission == "mission-2"


def test_an_infinite_spill_threshold_becomes_the_labs_largest() -> None:
    """The sweep's ``inf`` (never spill) maps to the lab's 60 s ceiling."""
    url = lab_url_for_run("mission-4", "exact", 4, options={"spill_threshold_s": math.inf})
    assert url is not None
    assert dict(parse_qsl(urlsplit(url).query))["spill_threshold_s"] == "60"


def test_scenarios_the_lab_cannot_show_get_no_link() -> None:
    """The document library and unknown variants are not chat traffic the lab draws."""
    assert lab_url_for_run("contract-library", "round_robin", 8) is None
    assert lab_url_for_run("belgavi", "round_robin", 6, variant="burst") is None


def test_the_no_cache_variant_turns_the_cache_off() -> None:
    """Belgavi's no-cache baseline opens with the cache off."""
    url = lab_url_for_run("belgavi", "round_robin", 7, variant="no_cache")
    assert url is not None
    assert dict(parse_qsl(urlsplit(url).query))["cache_enabled"] == "false"
