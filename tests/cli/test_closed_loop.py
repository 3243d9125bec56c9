"""The closed loop of issue 16: record real traffic at the gateway, plan on the recording,
replay the recording through the gateway the plan chose; the plan's prediction holds."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from kvreuse.cli.main import main
from kvreuse.sim.workloads import ChatWorkload, Tenant
from kvreuse.testing.loadgen import chat_calls, run_calls
from kvreuse.testing.processes import EngineSpec, Fleet

# Slow prefill, so TTFT is the engines' work and not the HTTP stack of a loaded test machine.
# Eight system prompts: the cold first turns are over 5 % of the requests, so p95 is a cold
# prefill and not the edge between cold and warm ones (which a few ms decide).
ENGINE = EngineSpec(cache_tokens=400_000, block_size=16, prefill_tokens_per_s=4_000.0,
                    overhead_ms=15.0, tpot_ms=2.0, events=False)
BLOCK = 16


def test_record_plan_replay_agree(tmp_path: Path) -> None:
    """Multi-turn chats through a recording gateway over 4 engines; `kvreuse plan` on the
    recording; the recording replayed through a gateway configured as the plan chose, over
    fresh engines: token hit rate within 3 points and p95 TTFT within 25 % of the plan's cell."""
    record_dir = tmp_path / "rec"
    chats = ChatWorkload(tenants=(Tenant("acme", 5.0),), duration_s=16.0, warmup_s=0.0,
                         system_prompts=8, system_tokens=600, turns=(3, 3),
                         user_tokens=(40, 40), answer_tokens=(60, 60), gap_s=(1.0, 2.0))
    calls = chat_calls(chats, 7, model="sim", max_tokens=8)
    with Fleet(tmp_path / "record") as fleet:
        engines = fleet.start_engines(4, ENGINE)
        gateway = fleet.start_gateway(
            "gateway", engines, policy="round_robin",
            extra_args=["--record", str(record_dir), "--record-block-size", str(BLOCK)])
        results = asyncio.run(run_calls(calls, lambda i, call: gateway.url))
        assert all(r.status == 200 for r in results), [r.error for r in results][:3]
        gateway.stop()
    recorded = tmp_path / "recorded.jsonl"
    assert main(["trace", "merge", str(record_dir), "--out", str(recorded),
                 "--block-size", str(BLOCK)]) == 0
    assert len(recorded.read_text().splitlines()) == len(calls)

    plan_json = tmp_path / "plan.json"
    assert main(["plan", "--trace", str(recorded), "--trace-block-size", str(BLOCK),
                 "--slo", "ttft_p95=1.5", "--replicas", "2,4",
                 "--policy", "round_robin,cache_aware,prefix_hash",
                 "--cache-tokens", str(ENGINE.cache_tokens), "--prefill-rate", "4000",
                 "--overhead", "0.015", "--tpot", "0.002", "--serial", "--no-cache",
                 "--json", str(plan_json)]) == 0
    winner = json.loads(plan_json.read_text())["winner"]
    assert winner is not None

    options = []
    if winner["knob"] is not None:
        options = ["--policy-option", f"{winner['knob']}={winner['knob_value']}"]
    replay_json = tmp_path / "replay.json"
    with Fleet(tmp_path / "replay") as fleet:
        engines = fleet.start_engines(winner["replicas"], ENGINE)
        gateway = fleet.start_gateway("gateway", engines, policy=winner["policy"],
                                      extra_args=options)
        assert main(["replay", "--trace", str(recorded), "--target", gateway.url,
                     "--block-size", str(BLOCK), "--model", "sim", "--max-tokens", "8",
                     "--engine-metrics", ",".join(e.url for e in engines),
                     "--json", str(replay_json)]) == 0
    measured = json.loads(replay_json.read_text())
    assert measured["errors"] == 0
    assert abs(measured["engine_hit_rate"] - winner["token_hit_rate"]) <= 0.03, (
        measured, winner)
    assert abs(measured["ttft_p95_s"] - winner["ttft_p95_s"]) <= 0.25 * winner["ttft_p95_s"], (
        measured, winner)
