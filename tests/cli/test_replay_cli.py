"""`kvreuse replay` against a real `kvreuse engine` over HTTP."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from kvreuse.cli.main import main
from kvreuse.testing.mooncake import synthetic_mooncake
from kvreuse.testing.processes import EngineSpec, Fleet
from kvreuse.testing.servers import answering_server, trickle
from kvreuse.trace.format import parse_trace_lines
from kvreuse.trace.stats import trace_stats

from .interrupt import interrupt_kvreuse


def test_replay_reproduces_the_traces_reuse_on_an_engine(tmp_path: Path) -> None:
    """Replayed to one engine with room for everything, the engines' hit rate (from /metrics)
    equals usage's and lands within 3 points of the trace's infinite-cache ceiling."""
    trace = tmp_path / "t.jsonl"
    lines = synthetic_mooncake(requests=40, requests_per_second=20.0, documents=3,
                               prefix_blocks=2)
    trace.write_text("\n".join(lines) + "\n")
    ceiling = trace_stats(parse_trace_lines(lines), 512, [1], [10**6]).infinite_hit_rate
    out, report = tmp_path / "r.json", tmp_path / "r.html"
    with Fleet(tmp_path / "fleet") as fleet:
        engine = fleet.start_engine("e0", EngineSpec(events=False, cache_tokens=200_000))
        assert main(["replay", "--trace", str(trace), "--target", engine.url, "--speed", "2",
                     "--engine-metrics", engine.url, "--max-tokens", "4", "--json", str(out),
                     "--report", str(report)]) == 0
    data = json.loads(out.read_text())
    assert data["sent"] == data["ok"] == 40 and data["errors"] == 0
    assert data["engine_hit_rate"] == pytest.approx(data["usage_hit_rate"], abs=1e-9)
    assert abs(data["engine_hit_rate"] - ceiling) <= 0.03
    assert 0 < data["ttft_p50_s"] <= data["ttft_p95_s"] <= data["ttft_p99_s"]
    assert "data:image/png;base64," in report.read_text()


def test_replay_reports_an_unreachable_target_as_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing listening: every request is an error, exit 1, no traceback."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(synthetic_mooncake(requests=3, requests_per_second=50.0)) + "\n")
    from kvreuse.testing.processes import free_port

    code = main(["replay", "--trace", str(trace), "--target", f"http://127.0.0.1:{free_port()}",
                 "--timeout", "5", "--model", "sim"])
    out = capsys.readouterr()
    assert code == 1 and "first error" in out.out and "Traceback" not in out.err


def test_replay_sends_the_model_the_target_serves(tmp_path: Path) -> None:
    """Without --model and with no model in the trace, requests name the first model the
    target's /v1/models lists, so replaying to a default engine just works."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(synthetic_mooncake(requests=5, requests_per_second=50.0)) + "\n")
    out = tmp_path / "r.json"
    with Fleet(tmp_path / "fleet") as fleet:
        engine = fleet.start_engine("e0", EngineSpec(model="only-this-one", events=False))
        assert main(["replay", "--trace", str(trace), "--target", engine.url,
                     "--max-tokens", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["sent"] == data["ok"] == 5


def test_replay_without_a_model_names_the_flag_when_the_target_cannot_say(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No --model, none in the trace and no /v1/models to read: an error naming --model."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(synthetic_mooncake(requests=1)[0] + "\n")
    from kvreuse.testing.processes import free_port

    code = main(["replay", "--trace", str(trace), "--target", f"http://127.0.0.1:{free_port()}",
                 "--timeout", "5"])
    err = capsys.readouterr().err
    assert code == 1 and "--model" in err and "/v1/models" in err and "Traceback" not in err


def test_replay_refuses_a_non_http_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--target must be http://."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(synthetic_mooncake(requests=1)[0] + "\n")
    assert main(["replay", "--trace", str(trace), "--target", "ftp://x"]) == 1
    assert "--target" in capsys.readouterr().err


def test_speed_and_duration_shape_the_schedule(tmp_path: Path) -> None:
    """--speed 2 halves every send time; --duration keeps the sends due before it."""
    import argparse

    from kvreuse.cli.replay import build_calls

    lines = synthetic_mooncake(requests=50, requests_per_second=5.0)
    records = parse_trace_lines(lines)
    base = {"tokenizer": None, "block_size": 512, "vocab_size": 8192, "first_token": 100,
            "model": "m", "max_tokens": 16, "duration": None, "max_prompt_tokens": 131_072,
            "trace": "t.jsonl"}
    normal = list(build_calls(records, argparse.Namespace(speed=1.0, **base)))
    fast = list(build_calls(records, argparse.Namespace(speed=2.0, **base)))
    assert [c.at_s / 2 for c in normal] == pytest.approx([c.at_s for c in fast])
    cut = list(build_calls(records, argparse.Namespace(speed=1.0, **{**base, "duration": 3.0})))
    assert 0 < len(cut) < len(normal) and all(c.at_s <= 3.0 for c in cut)
    assert cut == normal[: len(cut)]


@pytest.mark.parametrize("speed", ["1e-320", "1e-300", "1e-8"])
def test_a_speed_that_makes_the_replay_last_over_a_month_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], speed: str
) -> None:
    """A mistaken --speed (1e-320 made every send time infinite, and the replay waited
    forever) is refused naming the first request past a month, before anything is sent; a
    --duration that keeps the replay short lets it through."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(synthetic_mooncake(requests=5, requests_per_second=5.0)) + "\n")
    args = ["replay", "--trace", str(trace), "--target", "http://127.0.0.1:9", "--model", "m",
            "--timeout", "1", "--speed", speed]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "--speed" in err and "t.jsonl:" in err and "over 30 days" in err, err
    main([*args, "--duration", "1"])
    assert "over 30 days" not in capsys.readouterr().err


def test_replay_refuses_prompts_over_the_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A trace line claiming a huge prompt is refused by line and field before anything is
    built or sent."""
    trace = tmp_path / "t.jsonl"
    ids = list(range(400))
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 400 * 512,
                                 "output_length": 1, "hash_ids": ids}) + "\n")
    assert main(["replay", "--trace", str(trace), "--target", "http://127.0.0.1:9"]) == 1
    err = capsys.readouterr().err
    assert "t.jsonl:1" in err and "'input_length'" in err and "--max-prompt-tokens" in err


def hostile_target(answer: bytes | None) -> Any:
    """A target on 127.0.0.1 that reads each request head and sends ``answer`` (None: trickles
    a byte every 0.1 s); a context manager yielding its URL."""
    return answering_server(trickle if answer is None else (lambda conn: conn.sendall(answer)))


def sse_answer(cached: str) -> bytes:
    """A streamed completion whose usage chunk says ``cached`` cached tokens (raw JSON)."""
    body = ('data: {"choices":[{"text":"a"}]}\n\n'
            'data: {"choices":[],"usage":{"prompt_tokens":10,"prompt_tokens_details":'
            f'{{"cached_tokens":{cached}}}}}}}\n\ndata: [DONE]\n\n').encode()
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def test_absurd_usage_cached_tokens_are_left_out(tmp_path: Path) -> None:
    """cached_tokens of 10**400 (or negative) is not a count: the run ends normally with no
    usage hit rate instead of an OverflowError."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(synthetic_mooncake(requests=2, requests_per_second=50.0)) + "\n")
    hostile = hostile_target(sse_answer("1" + "0" * 400))
    out = tmp_path / "r.json"
    with hostile as target:
        assert main(["replay", "--trace", str(trace), "--target", target, "--model", "m",
                     "--timeout", "5", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["ok"] == 2 and data["usage_cached_tokens"] is None
    assert data["usage_hit_rate"] is None


def test_unreadable_engine_metrics_are_not_a_zero_hit_rate(tmp_path: Path) -> None:
    """--engine-metrics that cannot be read give no engine hit rate (usage's is used), not 0 %."""
    from kvreuse.testing.processes import free_port

    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(synthetic_mooncake(requests=2, requests_per_second=50.0)) + "\n")
    hostile = hostile_target(sse_answer("0"))
    out = tmp_path / "r.json"
    with hostile as target:
        assert main(["replay", "--trace", str(trace), "--target", target, "--model", "m",
                     "--engine-metrics", f"http://127.0.0.1:{free_port()}", "--timeout", "5",
                     "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["engine_hit_rate"] is None and data["token_hit_rate"] == 0.0


@pytest.mark.timeout(60)
def test_a_trickling_models_endpoint_is_cut_at_the_timeout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Asking a target that trickles a byte every 0.1 s for its model ends at --timeout with an
    error naming --model."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(synthetic_mooncake(requests=1)[0] + "\n")
    hostile = hostile_target(None)
    started = time.monotonic()
    with hostile as target:
        code = main(["replay", "--trace", str(trace), "--target", target, "--timeout", "1"])
    err = capsys.readouterr().err
    assert code == 1 and time.monotonic() - started < 5.0
    assert "within 1 s" in err and "--model" in err and "Traceback" not in err


def test_failures_are_counted_by_kind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A 503 storm is summed up as 'N × HTTP 503' and the first error shows status and body."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(synthetic_mooncake(requests=3, requests_per_second=50.0)) + "\n")
    hostile = hostile_target(
        b"HTTP/1.1 503 Busy\r\nContent-Length: 9\r\n\r\nover\nload")
    with hostile as target:
        assert main(["replay", "--trace", str(trace), "--target", target, "--model", "m",
                     "--timeout", "5"]) == 1
    out = capsys.readouterr().out
    assert "errors: 3 × HTTP 503" in out and "first error: HTTP 503: over load" in out


def test_calls_are_built_only_as_they_are_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planning a replay synthesizes no prompt; each call's prompt is built when it is taken, so
    a replay holds one body at a time whatever the trace's length."""
    import argparse

    from kvreuse.cli.replay import build_calls
    from kvreuse.trace.replay import PromptSynthesizer

    built: list[int] = []
    real_prompt = PromptSynthesizer.prompt
    monkeypatch.setattr(PromptSynthesizer, "prompt",
                        lambda self, record: built.append(record.line) or real_prompt(self, record))
    records = parse_trace_lines(synthetic_mooncake(requests=50, requests_per_second=5.0))
    calls = build_calls(records, argparse.Namespace(
        tokenizer=None, block_size=512, vocab_size=8192, first_token=100, model="m",
        max_tokens=16, duration=None, max_prompt_tokens=131_072, trace="t.jsonl", speed=1.0))
    assert len(calls) == 50 and built == []
    taken = iter(calls)
    first, second = next(taken), next(taken)
    assert built == [1, 2] and first.at_s <= second.at_s


def test_ctrl_c_ends_a_replay_with_the_figures_so_far(tmp_path: Path) -> None:
    """SIGINT mid-replay: exit 130, a line counting the requests that finished and those cut
    off, the table and the JSON of those that finished, and no traceback."""
    trace, out = tmp_path / "t.jsonl", tmp_path / "r.json"
    trace.write_text("\n".join(synthetic_mooncake(
        requests=200, requests_per_second=20.0, documents=3, prefix_blocks=2)) + "\n")
    with Fleet(tmp_path / "fleet") as fleet:
        engine = fleet.start_engine("e0", EngineSpec(events=False, tpot_ms=50.0))

        def two_seconds_in(child: subprocess.Popen[str]) -> None:
            assert child.stdout is not None
            first_line = child.stdout.readline()
            assert "replaying 200 requests" in first_line, first_line
            time.sleep(2.0)

        stopped = interrupt_kvreuse(
            ["replay", "--trace", str(trace), "--target", engine.url, "--model", "sim",
             "--max-tokens", "30", "--json", str(out)], two_seconds_in)
    rest = stopped.output
    assert stopped.code == 130, rest
    assert "interrupted" in rest and "cut off" in rest and "TTFT p95" in rest, rest
    assert "Traceback" not in rest and "Exception" not in rest, rest
    data = json.loads(out.read_text())
    assert data["interrupted"] is True and data["errors"] == 0
    assert 0 < data["ok"] == data["sent"] < 200 and data["cut_off"] > 0


def test_a_client_that_cannot_keep_up_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A trace sped up past what this client can build and send: the requests that left late
    are counted, and the line names --speed."""
    trace, out = tmp_path / "t.jsonl", tmp_path / "r.json"
    trace.write_text("\n".join(synthetic_mooncake(requests=300, requests_per_second=20.0)) + "\n")
    with hostile_target(sse_answer("0")) as target:
        main(["replay", "--trace", str(trace), "--target", target, "--model", "m",
              "--speed", "100000", "--timeout", "10", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["sent_late"] > 0 and data["worst_late_s"] >= 0.1
    printed = capsys.readouterr().out
    assert f"sent late: {data['sent_late']:,} of 300 requests" in printed and "--speed" in printed


def test_a_replay_on_time_reports_nothing_late(tmp_path: Path) -> None:
    """At the trace's own pace nothing leaves late."""
    trace, out = tmp_path / "t.jsonl", tmp_path / "r.json"
    trace.write_text("\n".join(synthetic_mooncake(requests=10, requests_per_second=20.0)) + "\n")
    with hostile_target(sse_answer("0")) as target:
        assert main(["replay", "--trace", str(trace), "--target", target, "--model", "m",
                     "--timeout", "10", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["sent_late"] == 0 and data["worst_late_s"] < 0.1
