"""benchmarks/default_vs_peers.py's noise estimate: jittered replays of a workload.

No simulation here beyond one tiny workload: the benchmark's figures are printed by the script.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from kvreuse.sim.requests import SimRequest
from kvreuse.tokens import pack

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "default_vs_peers.py"


def stream(count: int) -> list[SimRequest]:
    return [
        SimRequest(i, float(i), pack([i, i + 1]), 2, 1) for i in range(count)
    ]


def test_jitter_moves_each_arrival_by_at_most_the_width(bench: ModuleType) -> None:
    """Every request keeps its id and tokens; its arrival moves by at most ±width."""
    original = stream(50)
    moved = {r.request_id: r for r in bench.jittered(original, 3, 0.4)}
    assert sorted(moved) == [r.request_id for r in original]
    for request in original:
        shifted = moved[request.request_id]
        assert shifted.tokens == request.tokens
        assert abs(shifted.arrival_s - request.arrival_s) <= 0.4
        assert shifted.arrival_s >= 0.0
    assert any(moved[r.request_id].arrival_s != r.arrival_s for r in original)


def test_jittered_stream_is_in_arrival_order_and_seeded(bench: ModuleType) -> None:
    """The replay is sorted by arrival; one seed gives one stream, another seed another."""
    original = stream(50)
    first = bench.jittered(original, 1, 2.0)
    arrivals = [r.arrival_s for r in first]
    assert arrivals == sorted(arrivals)
    assert [r.arrival_s for r in bench.jittered(original, 1, 2.0)] == arrivals
    assert [r.arrival_s for r in bench.jittered(original, 2, 2.0)] != arrivals


def test_jitter_runs_print_the_spread_per_policy(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    """--jitter-runs prints one spread row per policy for the workload it replays."""
    bench.main(["--workloads", "mission-3", "--jitter-runs", "1"])
    out = capsys.readouterr().out
    assert "mission-3: seed-0 run and 1 replays with arrivals jittered by ±0.5 s" in out
    spread = out.split("jittered by")[1]
    for policy in ("relative_spill", "cache_aware", "cache_aware_sglang", "llm_d", "dynamo_kv"):
        assert f"| {policy} | " in spread
    assert "(sd " in spread


def test_jobs_change_nothing_but_the_speed(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two worker processes print the same tables and return the same status as one."""
    argv = ["--workloads", "mission-3,belgavi", "--jitter-runs", "1"]
    alone = bench.main(argv)
    serial = capsys.readouterr().out
    together = bench.main([*argv, "--jobs", "2"])
    assert (together, capsys.readouterr().out) == (alone, serial)
    assert "| belgavi x3 |" in serial and "| mission-3 x3 |" in serial


def test_arrival_probe_counts_requests_sent_past_a_longer_prefix(bench: ModuleType) -> None:
    """Round robin sends chat turns past the replica holding their history, and the probe
    counts them; the longest prefix held anywhere is never shorter than the chosen one's."""
    workload = bench.load("mission-3", bench.TRACE)
    probe = bench.probe_arrivals("round_robin", workload, {})
    assert probe.requests == sum(r.measured for r in workload.requests)
    assert 0 < probe.requests_elsewhere < probe.requests
    assert probe.best_cached_tokens > probe.chosen_cached_tokens > 0
    assert probe.prompt_tokens == sum(r.prompt_len for r in workload.requests if r.measured)


def test_arrival_probe_reads_the_caches_without_changing_the_run(bench: ModuleType) -> None:
    """Asking every cache at each arrival touches no LRU: the probed run's hit rate is the
    plain run's, to the last digit."""
    workload = bench.load("mission-3", bench.TRACE)
    for policy in ("relative_spill", "cache_aware_smg"):
        options = bench.options_for(policy, workload, {})
        probe = bench.probe_arrivals(policy, workload, options)
        plain = bench.simulate(policy, workload, options)
        assert probe.token_hit_rate == plain.token_hit_rate
        assert probe.best_cached_tokens >= probe.chosen_cached_tokens


def test_at_arrival_prints_one_row_per_policy(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    """--at-arrival prints the probe's row for the candidate, the reference and every peer."""
    assert bench.main(["--workloads", "mission-3", "--at-arrival"]) == 0
    out = capsys.readouterr().out
    for policy in ("relative_spill", "cache_aware", *bench.PEERS):
        assert f"| mission-3 | {policy} | " in out
    assert "longest cached anywhere at arrival" in out


def bounds(bench: ModuleType, pooled: float) -> object:
    return bench.Bounds(infinite_hit_rate=0.9, pooled_lru_hit_rate=pooled, replicas=2,
                        cache_tokens=100)


def test_spread_means_average_hit_rate_and_p95(bench: ModuleType) -> None:
    """A spread's means are the plain means of its runs' hit rates and p95s."""
    means = bench.Spread("p", (0.5, 0.7, 0.6), (1.0, 3.0, 2.0)).means()
    assert (means.token_hit_rate, means.ttft_p95_s) == pytest.approx((0.6, 2.0))


def test_verdict_on_means_needs_both_figures(bench: ModuleType) -> None:
    """Judged on means: a higher mean hit rate with a higher mean p95 than the best peer fails,
    at most its p95 passes."""
    peer = bench.Means(0.60, 1.0)
    slow = bench.Verdict("w", bench.Means(0.61, 1.1), peer, {"smg": peer}, bounds(bench, 0.61))
    quick = bench.Verdict("w", bench.Means(0.61, 1.0), peer, {"smg": peer}, bounds(bench, 0.61))
    assert (slow.passed, quick.passed) == (False, True)


def test_jitter_runs_judge_the_means_and_set_the_exit_status(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    """With --jitter-runs the script prints a second verdict table on the means, and its exit
    status is 0 exactly when every verdict there is PASS."""
    status = bench.main(["--workloads", "mission-3", "--jitter-runs", "1"])
    out = capsys.readouterr().out
    on_means = out.split("On the means of the seed-0 run and 1 jittered replays")[1]
    verdict_row = next(line for line in on_means.splitlines() if line.startswith("| mission-3"))
    assert status == (0 if "| PASS |" in verdict_row else 1)


def test_paired_gap_subtracts_run_by_run(bench: ModuleType) -> None:
    """The paired gap is the mean of run-by-run differences with twice its standard error, and
    counts the runs where the candidate's hit rate was at least the peer's."""
    candidate = bench.Spread("c", (0.70, 0.72, 0.71), (1.0, 2.0, 3.0))
    peer = bench.Spread("p", (0.71, 0.70, 0.71), (1.5, 1.5, 3.0))
    gap = bench.PairedGap.of(candidate, peer)
    assert gap.hit_diffs == pytest.approx((-0.01, 0.02, 0.0))
    mean, two_se = bench.PairedGap.mean_and_two_se(gap.hit_diffs)
    assert mean == pytest.approx(0.01 / 3)
    assert two_se == pytest.approx(2 * 0.015275252 / 3 ** 0.5, rel=1e-6)
    assert "| 2 of 3 |" in gap.cells()


@pytest.mark.parametrize(("hits", "p95s", "needed", "reading"), [
    ((0.0, 0.0, 0.0), (0.0, 0.0, 0.0), 0.0, "FAIL within noise"),
    ((-0.01, 0.01, -0.006), (0.0, 0.0, 0.0), 0.0, "FAIL within noise"),
    ((-0.011, -0.01, -0.009), (0.0, 0.0, 0.0), 0.0, "FAIL beyond noise on hit rate"),
    ((0.0, 0.0, 0.0), (0.1, 0.2, 0.3), 0.0, "FAIL beyond noise on p95"),
    ((0.01, 0.01, 0.01), (0.0, 0.0, 0.0), 0.02, "FAIL beyond noise on hit rate"),
    ((-0.011, -0.01, -0.009), (0.1, 0.2, 0.3), 0.0,
     "FAIL beyond noise on hit rate and p95"),
])
def test_a_failed_verdict_reads_as_within_or_beyond_noise(
    bench: ModuleType, hits: tuple[float, ...], p95s: tuple[float, ...], needed: float,
    reading: str,
) -> None:
    """A FAIL is within noise when each figure is within two standard errors of what it
    needed (level with the peer, or half the gap to the ceiling over it), else it names the
    figures beyond."""
    gap = bench.PairedGap("p", hits, p95s)
    assert gap.reading(False, needed) == reading
    assert gap.reading(True, needed) == "PASS"


@pytest.mark.parametrize(("argv", "said"), [
    (["--option", "slack=-1"], "slack must be >= 0"),
    (["--option", "bogus=1"], "has no option(s) bogus"),
    (["--policy", "nosuch"], "unknown policy 'nosuch'"),
    (["--workloads", "nosuch"], "no workload of 'nosuch' could be loaded"),
    (["--jitter-runs", "1", "--jitter-s", "inf"], "--jitter-s finite"),
    (["--jobs", "-1"], "--jobs must be 1..64, or 0 for one per CPU; got -1"),
    (["--jobs", "10000"], "--jobs must be 1..64, or 0 for one per CPU; got 10000"),
    (["--at-arrival", "--jitter-runs", "2"], "--at-arrival probes the seed-0 run"),
])
def test_caller_mistakes_are_refused_with_a_message(
    bench: ModuleType, capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    """A bad candidate option, an unknown policy or workload, an infinite jitter width or
    jittered replays with --at-arrival stop the script with a usage error naming it, before any
    workload runs (no traceback, no "PASS on 0 of 0")."""
    with pytest.raises(SystemExit) as stopped:
        bench.main(argv)
    assert stopped.value.code == 2
    assert said in capsys.readouterr().err


def test_hot_prefix_queues_on_one_replica_only_without_both_bounds(
    bench: ModuleType,
) -> None:
    """hot-prefix-2: every request shares one 2,000-token prefix at about 1.4 × one replica's
    capacity. Without the bound on the replicas lacking the prefix and without copies for a
    prefix's demand, relative_spill keeps every request on one replica (max/mean load 2) and
    its p95 grows with the run; with the bound alone one late spill copies the prefix; with
    the default, the copy comes as soon as the prefix's demand shows: a p95 at most llm-d's
    (the best peer there) at its hit rate."""
    workload = bench.load("hot-prefix-2", bench.TRACE)
    shared = workload.requests[0].tokens[:8000]  # 2,000 tokens of 4 bytes
    assert all(r.tokens[:8000] == shared for r in workload.requests)
    assert len({r.tokens for r in workload.requests}) == len(workload.requests)
    inf = float("inf")
    unbounded = bench.simulate("relative_spill", workload,
                               {"alternative_slack": inf, "copy_utilisation": inf})
    bounded = bench.simulate("relative_spill", workload, {"copy_utilisation": inf})
    default = bench.simulate("relative_spill", workload, {})
    llm_d = bench.simulate("llm_d", workload, bench.options_for("llm_d", workload, {}))
    assert unbounded.max_over_mean_load == pytest.approx(2.0)
    assert bounded.max_over_mean_load < 1.3
    assert bounded.ttft_p95_s < unbounded.ttft_p95_s / 3
    assert default.ttft_p95_s <= llm_d.ttft_p95_s < bounded.ttft_p95_s / 10
    assert default.token_hit_rate >= llm_d.token_hit_rate


def test_prefill_speeds_slow_the_first_replicas_and_only_kvreuse_measures(
        bench: ModuleType) -> None:
    """--prefill-speeds puts every fleet's first replicas at those speeds (the rest at 1);
    kvreuse's policies measure them, the peers' rules see the replicas alike."""
    workload = bench.load("hot-prefix-4", bench.TRACE, (0.25, 0.5))
    assert workload.fleet.prefill_speeds == (0.25, 0.5, 1.0, 1.0)
    assert bench.load("hot-prefix-4", bench.TRACE).fleet.prefill_speeds is None
    assert bench.fleet_for("relative_spill", workload).speed_view == "measured"
    assert bench.fleet_for(bench.REFERENCE, workload).speed_view == "measured"
    for peer in bench.PEERS:
        assert bench.fleet_for(peer, workload).speed_view == "alike"


def test_throttle_slows_the_first_replica_for_a_share_of_the_run(bench: ModuleType) -> None:
    """--throttle 0.3,0.55,0.25 puts the first replica at a quarter speed from 30 % to 55 % of
    the arrivals' span and back at 1 after; kvreuse's policies measure it, the peers do not."""
    workload = bench.load("hot-prefix-4", bench.TRACE, (), (0.3, 0.55, 0.25))
    first, last = workload.requests[0].arrival_s, workload.requests[-1].arrival_s
    (start, replica, slow), (end, back, restored) = workload.fleet.speed_changes
    assert (replica, slow, back, restored) == (0, 0.25, 0, 1.0)
    assert start == pytest.approx(first + 0.3 * (last - first))
    assert end == pytest.approx(first + 0.55 * (last - first))
    assert workload.fleet.prefill_speeds is None
    assert bench.fleet_for("relative_spill", workload).speed_view == "measured"
    for peer in bench.PEERS:
        assert bench.fleet_for(peer, workload).speed_view == "alike"


@pytest.mark.parametrize(("value", "said"), [
    ("0.3,0.55", "give START,END,SPEED"), ("a,b,c", "must be numbers"),
    ("0.6,0.5,0.25", "need 0 <= START < END <= 1"), ("0.1,1.5,0.25", "need 0 <= START < END"),
    ("0.1,0.5,0", "the throttle's SPEED must be a number from 0.001"),
])
def test_a_bad_throttle_is_refused_with_a_message(
    bench: ModuleType, capsys: pytest.CaptureFixture[str], value: str, said: str
) -> None:
    """A malformed --throttle is a usage error naming what to give, before any run."""
    with pytest.raises(SystemExit) as stopped:
        bench.main([f"--throttle={value}", "--workloads", "hot-prefix-2"])
    assert stopped.value.code == 2
    assert said in capsys.readouterr().err
