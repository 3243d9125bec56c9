"""`kvreuse replay` against a real vLLM replica: the trace's prefix structure reaches vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from kvreuse.cli.main import main
from kvreuse.testing.mooncake import synthetic_mooncake
from kvreuse.trace.format import parse_trace_lines
from kvreuse.trace.stats import trace_stats

from .vllm_fleet import MODEL_NAME, Replica


def small_trace(tmp_path: Path) -> tuple[Path, float]:
    """20 requests over 3 shared 4-block documents, 32-token blocks (vLLM's block size)."""
    # synthetic_mooncake writes 512-token blocks; rescale every length to 32-token blocks.
    rows = []
    for line in synthetic_mooncake(requests=20, requests_per_second=10.0, documents=3,
                                   prefix_blocks=4):
        row = json.loads(line)
        row["input_length"] = len(row["hash_ids"]) * 32 - row["input_length"] % 16
        rows.append(json.dumps(row))
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(rows) + "\n")
    ceiling = trace_stats(parse_trace_lines(rows, block=32), 32, [1], [10**6]).infinite_hit_rate
    return path, ceiling


@pytest.mark.parametrize("mode", ["token-ids", "text"])
def test_replay_to_vllm_reuses_the_traces_prefixes(
    replicas: list[Replica], model_dir: Path, tmp_path: Path, mode: str
) -> None:
    """Replayed to vLLM (token-id prompts, or text through the model's tokenizer), every
    request succeeds and vLLM's own counters show the trace's reuse: usage's cached tokens and
    /metrics agree, within 10 points of the infinite-cache ceiling."""
    target = replicas[0]
    assert httpx.post(target.url + "/reset_prefix_cache").status_code == 200
    trace, ceiling = small_trace(tmp_path)
    out = tmp_path / "r.json"
    extra = ["--tokenizer", str(model_dir)] if mode == "text" else ["--vocab-size", "8192"]
    assert main(["replay", "--trace", str(trace), "--target", target.url, "--model", MODEL_NAME,
                 "--block-size", "32", "--max-tokens", "2", "--speed", "2",
                 "--engine-metrics", target.url, "--json", str(out), *extra]) == 0
    data = json.loads(out.read_text())
    assert data["ok"] == 20 and data["errors"] == 0
    assert data["usage_hit_rate"] is not None and data["engine_hit_rate"] is not None
    assert abs(data["usage_hit_rate"] - data["engine_hit_rate"]) <= 0.02
    assert abs(data["engine_hit_rate"] - ceiling) <= 0.10, (data, ceiling)
