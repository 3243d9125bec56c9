"""Upstream health, load and /metrics parsing."""

from __future__ import annotations

import json

import pytest

from kvreuse.errors import InputFormatError
from kvreuse.gateway.config import UpstreamConfig
from kvreuse.gateway.upstreams import (
    UpstreamState,
    ejection_leaves_short,
    parse_model_list,
    parse_prometheus,
)

EXPOSITION = """\
# HELP vllm:num_requests_waiting Requests waiting
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m a"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m a"} 2.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250.0 1700000000
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9
"""


def state(clock: list[float] | None = None, **kwargs: object) -> UpstreamState:
    now = clock if clock is not None else [0.0]
    return UpstreamState(UpstreamConfig("http://h:1", **kwargs),  # type: ignore[arg-type]
                         eject_after=2, readmit_after=2, ejection_s=10.0,
                         clock=lambda: now[0])


def test_prometheus_text_is_summed_over_label_sets() -> None:
    """Wanted metrics are summed over engines; others and comments are skipped."""
    parsed = parse_prometheus(EXPOSITION)
    assert parsed == {"vllm:num_requests_waiting": 5.0,
                      "vllm:prefix_cache_queries_total": 1000.0,
                      "vllm:prefix_cache_hits_total": 250.0}


def test_a_malformed_line_does_not_cost_the_scrape() -> None:
    """An unreadable line is skipped and the rest of the page still counts; a metric whose name
    only begins like a wanted one is not summed into it."""
    page = ("vllm:num_requests_waiting{engine=\"0\"} not-a-number\n"
            "vllm:num_requests_waiting{engine=\"1\"} 2\n"
            "vllm:num_requests_waiting_by_reason{reason=\"x\"} 7\n"
            "}{ garbage\n"
            "vllm:num_requests_running 4 1700000000\n")
    assert parse_prometheus(page) == {"vllm:num_requests_waiting": 2.0,
                                      "vllm:num_requests_running": 4.0}


def test_ejection_after_repeated_failed_probes_and_readmission_by_probes() -> None:
    """eject_after failed probes eject; readmit_after passing probes re-admit."""
    upstream = state()
    assert not upstream.record_failure(probe=True) and upstream.healthy
    assert upstream.record_failure(probe=True) and not upstream.healthy
    assert not upstream.record_success(probe=False) and not upstream.healthy
    assert not upstream.record_success(probe=True)
    assert upstream.record_success(probe=True) and upstream.healthy
    assert upstream.ejections == 1


def test_a_failed_probe_and_a_failed_request_add_up() -> None:
    """Both streaks count toward eject_after (a dead upstream: its probe and a request)."""
    upstream = state()
    assert not upstream.record_failure(probe=True)
    assert upstream.record_failure(probe=False) and not upstream.healthy


def test_failed_requests_eject_although_probes_pass() -> None:
    """Passing probes do not end a streak of failed requests: it ejects (passive health)."""
    upstream = state()
    assert not upstream.record_failure(probe=False)
    assert not upstream.record_success(probe=True)  # /health answers between the failures
    assert upstream.record_failure(probe=False) and not upstream.healthy


def test_passive_ejection_lasts_its_time_then_probation_and_doubling() -> None:
    """Probes cannot re-admit before ejection_s; back on probation one failure re-ejects for
    twice as long; a served request ends the doubling."""
    clock = [0.0]
    upstream = state(clock)
    upstream.record_failure(probe=False)
    assert upstream.record_failure(probe=False)
    for _ in range(3):
        assert not upstream.record_success(probe=True)  # passing, but the 10 s are not over
    clock[0] = 10.0
    assert upstream.record_success(probe=True) and upstream.healthy
    assert upstream.record_failure(probe=False) and not upstream.healthy  # probation
    assert upstream.ejected_until == 30.0  # 20 s this time
    clock[0] = 30.0
    upstream.record_success(probe=True)
    assert upstream.record_success(probe=True) and upstream.healthy
    upstream.record_success(probe=False)  # it served a request: the streak is over
    upstream.record_failure(probe=False)
    assert upstream.healthy and upstream.record_failure(probe=False)
    assert upstream.ejected_until == 40.0


def named(name: str, models: tuple[str, ...] | None = None) -> UpstreamState:
    return UpstreamState(UpstreamConfig(f"http://{name}:1", name=name, models=models or ()),
                         eject_after=2, readmit_after=2)


def test_a_withheld_ejection_keeps_the_streak_and_a_failed_probe_ejects() -> None:
    """may_eject=False: the failed request counts, the upstream stays admitted, its next
    failed probe ejects it, and it is then held out for ejection_s as any passive ejection."""
    clock = [0.0]
    upstream = state(clock)
    assert not upstream.ejects_on_failure()
    upstream.record_failure(probe=False)
    assert upstream.ejects_on_failure()
    assert not upstream.record_failure(probe=False, may_eject=False) and upstream.healthy
    assert not upstream.record_failure(probe=False, may_eject=False)
    assert upstream.request_failures == 3 and upstream.ejections == 0
    assert upstream.record_failure(probe=True) and not upstream.healthy
    assert upstream.ejected_until == 10.0


def test_a_withheld_ejection_is_carried_out_when_the_cap_allows() -> None:
    """eject_withheld ejects an upstream kept past its streak as a failed request would
    have (held out for ejection_s); a served request ends the streak instead."""
    clock = [5.0]
    upstream = state(clock)
    for _ in range(2):
        upstream.record_failure(probe=False, may_eject=False)
    assert upstream.ejection_withheld
    upstream.eject_withheld()
    assert not upstream.healthy and not upstream.ejection_withheld
    assert upstream.ejected_until == 15.0 and upstream.ejections == 1
    served = state()
    for _ in range(2):
        served.record_failure(probe=False, may_eject=False)
    served.record_success(probe=False)
    assert not served.ejection_withheld and served.healthy


def test_one_ejection_per_model_is_always_allowed() -> None:
    """A lone upstream, or the first of two, may be ejected whatever the share; the second of
    two may not under 0.5, and may under 1 (the cap lifted)."""
    lone = named("lone")
    assert ejection_leaves_short(lone, [lone], 0.5) is None
    first, second = named("a"), named("b")
    assert ejection_leaves_short(first, [first, second], 0.5) is None
    first.healthy = False
    assert ejection_leaves_short(second, [first, second], 0.5) == "*"
    assert ejection_leaves_short(second, [first, second], 1.0) is None


@pytest.mark.parametrize(("fleet_size", "share", "may_go"), [
    (3, 0.5, 1), (4, 0.5, 2), (8, 0.5, 4), (10, 0.1, 1), (10, 0.34, 3), (3, 1.0, 3)])
def test_the_share_bounds_how_many_go(fleet_size: int, share: float, may_go: int) -> None:
    """Ejecting one by one, exactly max(1, floor(share * n)) of n upstreams may go."""
    fleet = [named(f"u{i}") for i in range(fleet_size)]
    gone = 0
    for upstream in fleet:
        if ejection_leaves_short(upstream, fleet, share) is not None:
            break
        upstream.healthy = False
        gone += 1
    assert gone == may_go


def test_the_share_is_counted_per_model_and_removed_upstreams_do_not_count() -> None:
    """An upstream of models x and y is judged against each model's upstreams: y's second of
    two is out, so it stays, although x has three more; a removed upstream is no member."""
    both, x1, x2, x3, y2 = (named("both", ("x", "y")), named("x1", ("x",)), named("x2", ("x",)),
                            named("x3", ("x",)), named("y2", ("y",)))
    fleet = [both, x1, x2, x3, y2]
    y2.healthy = False
    assert ejection_leaves_short(both, fleet, 0.5) == "y"
    y2.removed = True
    assert ejection_leaves_short(both, fleet, 0.5) is None
    unknown = named("unknown")  # models not known yet: serves any model, judged on all
    x1.healthy = False
    assert ejection_leaves_short(x2, [*fleet, unknown], 0.5) is None  # x: 1 of 5 out
    x2.healthy = False
    assert ejection_leaves_short(x3, [*fleet, unknown], 0.5) == "x"  # 2 of 5 out already


def test_load_counts_what_the_gateway_sent_and_what_the_engine_reports() -> None:
    """Queued prefill tokens fall at first byte; extra engine waiting adds the mean size."""
    upstream = state()
    upstream.request_sent(100)
    upstream.request_sent(300)
    assert upstream.load().queued_prefill_tokens == 400 and upstream.load().in_flight == 2
    upstream.first_byte(100)
    assert upstream.load().queued_prefill_tokens == 300
    upstream.update_engine({"vllm:num_requests_waiting": 3.0})
    load = upstream.load()
    assert load.queued_requests == 3 and load.queued_prefill_tokens == 300 + 2 * 200


def test_a_replica_drained_since_its_scrape_carries_no_phantom_queue() -> None:
    """Requests the engine reported waiting that were this gateway's own at the scrape stop
    counting once they have started; only requests beyond the gateway's queue then (other
    clients) stay added until the next scrape."""
    upstream = state()
    for _ in range(3):
        upstream.request_sent(1000)
    upstream.update_engine({"vllm:num_requests_waiting": 3.0})
    for _ in range(3):
        upstream.first_byte(1000)
    assert upstream.load().queued_requests == 0
    assert upstream.load().queued_prefill_tokens == 0
    upstream.request_sent(1000)
    upstream.update_engine({"vllm:num_requests_waiting": 3.0})  # two are someone else's
    upstream.first_byte(1000)
    load = upstream.load()
    assert load.queued_requests == 2 and load.queued_prefill_tokens == 2 * 1000


def test_a_non_finite_scraped_queue_is_ignored() -> None:
    """NaN or +Inf from a broken exporter neither raises nor adds load."""
    upstream = state()
    upstream.request_sent(500)
    for value in (float("nan"), float("inf")):
        upstream.update_engine({"vllm:num_requests_waiting": value})
        assert upstream.load().queued_requests == 1
        assert upstream.load().queued_prefill_tokens == 500


def test_weight_scales_the_load() -> None:
    """An upstream of weight 2 looks half as loaded."""
    upstream = state(weight=2.0)
    upstream.request_sent(400)
    assert upstream.load().queued_prefill_tokens == 200


def test_engine_hit_rate_is_a_delta_since_the_first_scrape() -> None:
    """The engine's counters are read as deltas from the gateway's first scrape."""
    upstream = state()
    upstream.update_engine({"vllm:prefix_cache_queries_total": 100.0,
                            "vllm:prefix_cache_hits_total": 90.0})
    assert upstream.engine_hit_rate() is None
    upstream.update_engine({"vllm:prefix_cache_queries_total": 300.0,
                            "vllm:prefix_cache_hits_total": 140.0})
    assert upstream.engine_hit_rate() == 0.25


def test_model_list_keeps_each_card_once_in_order() -> None:
    """A vLLM /v1/models answer gives its cards in order; a repeated id is kept once."""
    raw = json.dumps({"object": "list", "data": [
        {"id": "base", "object": "model", "root": "/m"}, {"id": "lora-1", "parent": "base"},
        {"id": "base", "object": "model"}]}).encode()
    assert [card["id"] for card in parse_model_list(raw)] == ["base", "lora-1"]
    assert parse_model_list(b'{"data": []}') == ()


@pytest.mark.parametrize(
    ("raw", "needle"),
    [(b"{nope", "not JSON"), (b"\xff\xfe", "not JSON"), (b"[" * 100_000, "not JSON"),
     (b"[]", "'data' array"), (b'{"data": {}}', "'data' array"),
     (b'{"data": [{"name": "x"}]}', r"data\[0\] has no model id"),
     (b'{"data": [{"id": ""}]}', "no model id"), (b'{"data": ["x"]}', "no model id"),
     (b'{"data": [{"id": "' + b"m" * 600 + b'"}]}', "at most 512"),
     (b" " * (5 << 20), "limit")],
)
def test_garbled_model_lists_are_refused_by_what_is_wrong(raw: bytes, needle: str) -> None:
    """Anything but a list of model cards is an InputFormatError, never a crash."""
    with pytest.raises(InputFormatError, match=needle):
        parse_model_list(raw)


def test_declared_models_are_known_from_the_start() -> None:
    """A declared upstream serves its names at once; a learning one knows nothing yet."""
    declared, learning = state(models=("a", "b")), state()
    assert declared.serves("a") and declared.serves("c") is False
    assert learning.serves("a") is None
    assert learning.learned(({"id": "a"},)) and not learning.learned(({"id": "a"},))
    assert learning.serves("a") and learning.learned(())
    assert learning.serves("a") is False


def test_engine_hit_rate_is_counter_deltas_since_the_first_scrape() -> None:
    """The first scrape is the baseline: no queried tokens since gives None, then hits over
    queries of the deltas."""
    upstream = state()
    upstream.update_engine({"vllm:prefix_cache_queries_total": 100.0,
                            "vllm:prefix_cache_hits_total": 90.0})
    assert upstream.engine_hit_rate() is None and upstream.engine_deltas() == (0.0, 0.0)
    upstream.update_engine({"vllm:prefix_cache_queries_total": 300.0,
                            "vllm:prefix_cache_hits_total": 140.0})
    assert upstream.engine_deltas() == (200.0, 50.0) and upstream.engine_hit_rate() == 0.25
    upstream.update_engine({"vllm:num_requests_waiting": 1.0})  # counters gone from the page
    assert upstream.engine_hit_rate() is None and upstream.engine_deltas() is None


def test_load_carries_the_scraped_kv_capacity_else_the_configured_one() -> None:
    """Policies see the engine's KV capacity: what /metrics said, else capacity_tokens=."""
    assert state().load().kv_capacity_tokens is None
    configured = state(capacity_tokens=5000)
    assert configured.load().kv_capacity_tokens == 5000
    configured.kv_capacity_tokens = 8192
    assert configured.load().kv_capacity_tokens == 8192
