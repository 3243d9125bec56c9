"""deploy/monitoring: rules checked and unit-tested by promtool, then evaluated by a real
Prometheus scraping a real gateway and two ``kvreuse engine`` replicas on 127.0.0.1."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvreuse.testing.processes import EngineSpec, Fleet, Process, free_port, wait_http

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
RULES = MONITORING / "kvreuse-rules.yml"
DASHBOARD = MONITORING / "kvreuse-dashboard.json"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    assert binary is not None
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=120,
                          cwd=MONITORING)


def test_rules_pass_promtool_check() -> None:
    """promtool accepts the rules file and the example configuration."""
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 20 rules found" in checked.stdout
    config = promtool("check", "config", "prometheus.example.yml")
    assert config.returncode == 0, config.stdout + config.stderr


def test_rules_unit_tests_pass() -> None:
    """The rules' unit tests (hit rates, step drop, prediction error, ejections...) pass."""
    tested = promtool("test", "rules", "kvreuse-rules.test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries += [a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return queries


def test_dashboard_is_importable_and_reads_recorded_series() -> None:
    """The dashboard JSON has what Grafana's import needs; its panels read the recorded
    series of the rules file and each panel has a unique id."""
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) >= 10
    recorded = set(re.findall(r"- record: (\S+)", RULES.read_text()))
    used = {name for query in dashboard_queries() for name in recorded if name in query}
    assert {"instance_model:vllm_token_hit_rate:ratio_rate5m",
            "upstream:kvreuse_gateway_prediction_error:ratio_rate5m",
            "upstream:kvreuse_gateway_ejections:increase1h"} <= used


# ---------------------------------------------------------------------------------- live


def start_prometheus(fleet: Fleet, workdir: Path, gateway_metrics: str,
                     engines: list[Process]) -> str:
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": "kvreuse-gateway", "static_configs": [{"targets": [gateway_metrics]}]},
            {"job_name": "vllm", "static_configs": [
                {"targets": [e.url.removeprefix("http://") for e in engines]}]},
        ],
    }
    path = workdir / "prometheus.yml"
    path.write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    binary = shutil.which("prometheus")
    assert binary is not None
    proc = fleet.spawn("prometheus", [
        binary, f"--config.file={path}", f"--storage.tsdb.path={workdir / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
        "--storage.tsdb.retention.time=1h"], url=f"http://127.0.0.1:{port}", port=port)
    wait_http(proc, "/-/ready", timeout_s=60.0)
    return proc.url


def query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    response = httpx.get(prometheus + "/api/v1/query", params={"query": expr}, timeout=10)
    assert response.status_code == 200, (expr, response.text)
    result: list[dict[str, Any]] = response.json()["data"]["result"]
    return result


def counters(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url, timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def wait_until(check: Any, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last is True:
            return
        time.sleep(0.5)
    raise AssertionError(f"not reached in {timeout_s} s: {last}")


def test_prometheus_records_the_rules_from_live_processes(tmp_path: Path) -> None:
    """A real Prometheus scraping a gateway (--metrics-port) and two engines: the recorded hit
    rates and prediction error equal what the processes' counters say, every rule evaluates
    without error, and every dashboard query is valid PromQL."""
    with Fleet(tmp_path) as fleet:
        spec = EngineSpec(cache_tokens=65_536, prefill_tokens_per_s=1e6, overhead_ms=0.0,
                          tpot_ms=0.0)
        engines = fleet.start_engines(2, spec)
        metrics_port = free_port()
        gateway = fleet.start_gateway("gateway", engines, policy="exact", extra_args=[
            "--metrics-port", str(metrics_port), "--policy-option", "block_size=16"])
        gateway_metrics = f"127.0.0.1:{metrics_port}"
        prometheus = start_prometheus(fleet, tmp_path, gateway_metrics, engines)
        # Traffic only after the first scrape of every target, so the window starts at zero.
        wait_until(lambda: len([r for r in query(prometheus, "up == 1")]) == 3 or
                   query(prometheus, "up"))
        prompts = [uuid.uuid4().hex + " shared context " * 40 for _ in range(4)]
        for repeat in range(3):
            for prompt in prompts:
                response = httpx.post(gateway.url + "/v1/completions", timeout=10, json={
                    "model": "sim", "prompt": prompt + f" turn {repeat}", "max_tokens": 1})
                assert response.status_code == 200
            time.sleep(0.3)  # let KV events reach the gateway between rounds

        expected: dict[str, float] = {}
        hits_sum = queries_sum = 0.0
        for engine in engines:
            values = counters(engine.url + "/metrics")
            labels = (("engine", "0"), ("model_name", "sim"))
            hits = values[("vllm:prefix_cache_hits_total", labels)]
            queries = values[("vllm:prefix_cache_queries_total", labels)]
            hits_sum, queries_sum = hits_sum + hits, queries_sum + queries
            if queries:
                expected[engine.url.removeprefix("http://")] = hits / queries
        assert expected and hits_sum > 0

        def engine_rates_match() -> bool | object:
            got = {r["metric"]["instance"]: float(r["value"][1]) for r in
                   query(prometheus, "instance_model:vllm_token_hit_rate:ratio_rate5m")}
            fleet_rate = query(prometheus,
                               'model:vllm_token_hit_rate:ratio_rate5m{model_name="sim"}')
            if got.keys() != expected.keys() or not fleet_rate:
                return got
            close = all(abs(got[k] - v) < 1e-9 for k, v in expected.items())
            fleet_ok = abs(float(fleet_rate[0]["value"][1]) - hits_sum / queries_sum) < 1e-9
            return (close and fleet_ok) or (got, fleet_rate)

        wait_until(engine_rates_match)

        page = counters(f"http://{gateway_metrics}/metrics")
        upstreams = {e.name: e for e in engines}
        want_rate, want_error = {}, {}
        for name in upstreams:
            key = (("upstream", name),)
            prompt_tokens = page[("kvreuse_gateway_prompt_tokens_total", key)]
            if prompt_tokens:
                realized = page[("kvreuse_gateway_realized_cached_tokens_total", key)]
                predicted = page[("kvreuse_gateway_predicted_cached_tokens_total", key)]
                want_rate[name] = realized / prompt_tokens
                want_error[name] = (predicted - realized) / prompt_tokens

        def gateway_rates_match() -> bool | object:
            rate = {r["metric"]["upstream"]: float(r["value"][1]) for r in
                    query(prometheus, "upstream:kvreuse_gateway_token_hit_rate:ratio_rate5m")}
            error = {r["metric"]["upstream"]: float(r["value"][1]) for r in query(
                prometheus, "upstream:kvreuse_gateway_prediction_error:ratio_rate5m")}
            ok = (rate.keys() == want_rate.keys() and error.keys() == want_error.keys()
                  and all(abs(rate[k] - v) < 1e-9 for k, v in want_rate.items())
                  and all(abs(error[k] - v) < 1e-9 for k, v in want_error.items()))
            return ok or (rate, error, want_rate, want_error)

        wait_until(gateway_rates_match)
        # Its own rule, evaluated on its own turn: under load it can lag the rates' by a round.
        wait_until(lambda: bool(query(
            prometheus, "upstream_model:kvreuse_gateway_ttft_seconds:p95_rate5m")) or "none yet")
        assert query(prometheus, 'process_resident_memory_bytes{job="kvreuse-gateway"}')
        # The dashboard's deploy markers read every process's start time.
        starts = query(prometheus, 'process_start_time_seconds{job=~"vllm|kvreuse-gateway"}')
        assert len(starts) == 3

        groups = httpx.get(prometheus + "/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        assert len(rules) == 20
        assert [r["name"] for r in rules if r["health"] != "ok"] == []
        for expr in dashboard_queries():
            concrete = expr.replace("$model", ".*").replace("$upstream", ".*")
            if concrete.startswith("label_values("):
                metric = concrete.removeprefix("label_values(").split(",")[0]
                assert query(prometheus, metric), metric
                continue
            query(prometheus, concrete)  # a 400 (invalid PromQL) fails inside query()
