"""The lab's HTTP API on the real simulator, through starlette's TestClient."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import pytest
from starlette.testclient import TestClient

from kvreuse.routing import POLICIES
from kvreuse.web.app import MAX_BODY_BYTES, MAX_CONCURRENT_RUNS, create_app
from kvreuse.web.controls import LIMITS
from kvreuse.web.missions import MISSIONS

SHORT = {"duration_s": 12}
"""Twelve measured seconds keep each run well under a second while exercising everything."""


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(create_app())


def _run(client: TestClient, **controls: Any) -> dict[str, Any]:
    response = client.post("/api/run", json={**SHORT, **controls})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_the_page_and_its_static_files_are_served(client: TestClient) -> None:
    """GET / is the page; its script and stylesheet come from this server, not a CDN."""
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert '<script src="/static/lab.js">' in page.text
    assert "http://" not in page.text and "https://" not in page.text
    for path, kind in (("/static/lab.js", "javascript"), ("/static/lab.css", "text/css")):
        response = client.get(path)
        assert response.status_code == 200 and kind in response.headers["content-type"]
        assert "https://" not in response.text


def test_config_lists_every_policy_and_mission(client: TestClient) -> None:
    """The drop-downs are filled from the simulator's registries."""
    config = client.get("/api/config").json()
    assert config["choices"]["routing"] == list(POLICIES)
    assert set(config["choices"]["scheduling"]) == {"fcfs", "lpm"}
    assert [m["id"] for m in config["missions"]] == list(MISSIONS)
    assert config["defaults"]["scenario"] in config["choices"]["scenario"]


def test_a_run_returns_consistent_columns(client: TestClient) -> None:
    """Bars, tiles and tree of one run: columns line up and replica indices are in range."""
    body = _run(client, replicas=3, routing="cache_aware")
    req = body["requests"]
    n = len(req["arrival_s"])
    assert n > 0 and all(len(col) == n for col in req.values())
    assert body["replica_ids"] == ["r0", "r1", "r2"]
    assert set(req["replica"]) == {0, 1, 2}
    assert all(0 <= c <= p for c, p in zip(req["cached_tokens"], req["prompt_tokens"], strict=True))
    assert req["arrival_s"] == sorted(req["arrival_s"])
    assert req["arrival_s"][0] >= 0 and req["arrival_s"][-1] < SHORT["duration_s"]
    assert len(body["timeline"]) == SHORT["duration_s"]
    assert body["tiles"]["replicas"] == 3


def test_the_last_timeline_point_agrees_with_the_simulators_summary(client: TestClient) -> None:
    """The animated tiles end where kvreuse.sim.summarize's figures are."""
    body = _run(client, replicas=2, routing="exact", scheduling="lpm")
    last, tiles = body["timeline"][-1], body["tiles"]
    for key in ("token_hit_rate", "request_hit_rate", "prefill_gpu_s_per_1k", "ttft_p95_s"):
        assert last[key] == pytest.approx(tiles[key], abs=1e-3), key


def test_tiles_follow_from_the_requests(client: TestClient) -> None:
    """Token hit rate = cached / prompt tokens over the drawn requests."""
    body = _run(client, seed=3)
    req = body["requests"]
    expected = sum(req["cached_tokens"]) / sum(req["prompt_tokens"])
    assert body["tiles"]["token_hit_rate"] == pytest.approx(expected, abs=1e-4)


def test_cache_off_reuses_nothing_and_costs_full_prefill(client: TestClient) -> None:
    """With the cache off every prompt token is prefilled: 15 ms + tokens / 10,000 each."""
    body = _run(client, cache_enabled=False)
    req = body["requests"]
    assert sum(req["cached_tokens"]) == 0 and body["tiles"]["token_hit_rate"] == 0
    assert body["tree"] is None
    per_1k = (
        1000 * sum(0.015 + p / 10_000 for p in req["prompt_tokens"]) / len(req["prompt_tokens"])
    )
    assert body["tiles"]["prefill_gpu_s_per_1k"] == pytest.approx(per_1k, rel=1e-3)


def test_the_tree_is_replica_ones_at_mid_run(client: TestClient) -> None:
    """The snapshot is r0's, taken at the first arrival after half the measured window."""
    body = _run(client, replicas=2)
    tree = body["tree"]
    assert tree["replica_id"] == "r0"
    assert SHORT["duration_s"] / 2 <= tree["at_s"] < SHORT["duration_s"] / 2 + 1
    ids = {node["id"] for node in tree["nodes"]}
    assert tree["nodes"] and all(n["parent"] is None or n["parent"] in ids for n in tree["nodes"])
    assert {n["kind"] for n in tree["nodes"]} <= {"system", "user", "answer", "other"}
    assert "system" in {n["kind"] for n in tree["nodes"]}
    assert sum(n["tokens"] for n in tree["nodes"]) <= tree["total_tokens"]


def test_runs_are_deterministic_and_seeded(client: TestClient) -> None:
    """Equal controls give an equal answer; another seed gives other traffic."""
    first = _run(client, seed=11)
    again = _run(client, seed=11)
    other = _run(client, seed=12)
    first.pop("sim_wall_s"), again.pop("sim_wall_s")
    assert first == again
    assert other["requests"]["arrival_s"] != first["requests"]["arrival_s"]


def test_get_with_a_query_string_runs_like_a_post(client: TestClient) -> None:
    """What kvreuse.web.links.lab_url builds is a valid GET of the same run."""
    response = client.get("/api/run", params={"replicas": "2", "duration_s": "12", "seed": "5"})
    assert response.status_code == 200
    posted = _run(client, replicas=2, seed=5)
    assert response.json()["requests"] == posted["requests"]


def test_a_mission_run_reports_its_goal(client: TestClient) -> None:
    """Naming a mission adds the goal check, one entry per condition."""
    body = _run(client, **{**MISSIONS["mission-3"].preset, "mission": "mission-3"})
    goal = body["goal"]
    assert goal["mission"] == "mission-3" and goal["met"] is False
    assert len(goal["conditions"]) == len(MISSIONS["mission-3"].conditions) + 1


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"replicas": 0}, "replicas"),
        ({"replicas": 17}, "replicas"),
        ({"routing": "fastest"}, "routing"),
        ({"scheduling": "sjf"}, "scheduling"),
        ({"arrival_rate": -3}, "arrival_rate"),
        ({"cache_enabled": "on"}, "cache_enabled"),
        ({"cache_tokens": 1000}, "cache_tokens"),
        ({"timestamp_at": 1499}, "timestamp_at"),
        ({"scenario": "contract-library"}, "scenario"),
        ({"policy": "round_robin"}, "policy"),
        ([1, 2, 3], "body"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(client: TestClient, body: Any, field: str) -> None:
    """Every bad body answers 400 with the field to fix, and nothing is simulated."""
    response = client.post("/api/run", json=body)
    assert response.status_code == 400
    answer = response.json()
    assert answer["field"] == field
    assert field in answer["error"]


def test_malformed_json_is_a_400(client: TestClient) -> None:
    """A body that is not JSON names the body."""
    response = client.post("/api/run", content=b"{replicas: 3", headers={"content-type": "x"})
    assert response.status_code == 400 and response.json()["field"] == "body"


def test_oversized_bodies_are_refused(client: TestClient) -> None:
    """A body over the limit is refused with 413 before parsing."""
    response = client.post("/api/run", content=b" " * (MAX_BODY_BYTES + 1))
    assert response.status_code == 413 and response.json()["field"] == "body"
    assert f"{MAX_BODY_BYTES:,}" in response.json()["error"]


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b'{"routing": "\xff\xfe"}', "not valid UTF-8"),
        (b'{"routing": "\\ud800"}', "lone UTF-16 surrogate"),
        (b'{"seed": ' + b"9" * 5000 + b"}", "5,000 digits"),
        (b"[" * 5000 + b"]" * 5000, "nested too deeply"),
        (b'{"seed": NaN}', "NaN"),
        (b'{"arrival_rate": 1e999}', "out of range"),
        (b'{"seed": 1,}', "not valid JSON"),
    ],
)
def test_malformed_bodies_are_a_400_naming_the_problem(
    client: TestClient, body: bytes, problem: str
) -> None:
    """Invalid Unicode, huge integers, deep nesting, non-finite numbers: 400, never a 500."""
    response = client.post("/api/run", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["field"] == "body" and problem in response.json()["error"]


def test_one_run_may_not_ask_for_unbounded_work(client: TestClient) -> None:
    """Maximum rate for the longest duration is more than one run may simulate: 400."""
    response = client.post("/api/run", json={"arrival_rate": 200, "duration_s": 300})
    assert response.status_code == 400
    assert response.json()["field"] == "duration_s"
    assert f"{LIMITS.max_requests:,}" in response.json()["error"]


def test_config_states_the_work_limits(client: TestClient) -> None:
    """/api/config tells the page how much one run may ask for and how many run at once."""
    config = client.get("/api/config").json()
    assert config["limits"]["requests_per_run"] == [1, LIMITS.max_requests]
    assert config["max_concurrent_runs"] == MAX_CONCURRENT_RUNS


def test_bad_query_strings_name_the_field(client: TestClient) -> None:
    """GET /api/run?replicas=many is a 400 naming replicas."""
    response = client.get("/api/run", params={"replicas": "many"})
    assert response.status_code == 400 and response.json()["field"] == "replicas"


def test_refusals_are_logged_as_throttled_warnings(caplog: pytest.LogCaptureFixture) -> None:
    """A 400 shows in the log at the server's default level; a flood of them is throttled."""
    client = TestClient(create_app())
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kvreuse.lab"):
        for _ in range(30):
            assert client.post("/api/run", json={"replicas": 0}).status_code == 400
    windows = math.ceil(time.monotonic() - started) + 1  # the throttle: 10 lines a second
    lines = [r for r in caplog.records if r.name == "kvreuse.lab"]
    assert lines and all(r.levelno == logging.WARNING for r in lines)
    assert "replicas" in lines[0].getMessage() and len(lines) <= 10 * windows
