"""`kvreuse route --record`: the trace it writes, off the request path, and what it never holds."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kvreuse.cli.main import main
from kvreuse.errors import InputFormatError
from kvreuse.gateway.recorder import RecorderSettings, TraceRecorder
from kvreuse.gateway.telemetry import RequestRecord
from kvreuse.identity import CacheIdentity
from kvreuse.routing.base import RequestView
from kvreuse.tokens import pack
from kvreuse.trace.format import parse_trace_lines
from kvreuse.trace.keyed import KeyedIds

from .fleet import Engine, RunningGateway

SECRET = b"0123456789abcdef-recorder"


def finished(tokens: list[int], *, ago_s: float = 0.0, salt: str | None = None,
             session: str | None = None, status: int = 200) -> RequestRecord:
    view = RequestView("r", pack(tokens), len(tokens), CacheIdentity(cache_salt=salt), None,
                       session)
    record = RequestRecord("r", "/v1/completions", time.perf_counter() - ago_s, model="m",
                           upstream="u0", cached_tokens=3, status=status, view=view,
                           completion_tokens=7)
    record.first_byte = record.started + 0.01
    return record


def read_trace(directory: Path) -> list[str]:
    lines: list[str] = []
    for path in sorted(directory.glob("trace-*.jsonl")):
        lines += path.read_text().splitlines()
    return lines


def test_records_come_out_in_arrival_order_with_their_facts(tmp_path: Path) -> None:
    """Requests finishing out of order are written by arrival; every field is filled."""
    recorder = TraceRecorder(RecorderSettings(tmp_path, SECRET, block=4, reorder_s=0.5))
    recorder.start()
    assert recorder.submit(finished(list(range(10)), ago_s=0.0))
    assert recorder.submit(finished(list(range(6)), ago_s=0.2, session="s1"))
    assert not recorder.submit(finished([1, 2], status=500))
    recorder.close()
    records = parse_trace_lines(read_trace(tmp_path), block=4)
    assert [r.input_length for r in records] == [6, 10]
    first, second = records
    assert first.timestamp_ms <= second.timestamp_ms
    assert first.hash_ids[0] == second.hash_ids[0]  # tokens 0-3 shared
    assert first.hash_ids[1] != second.hash_ids[1]  # tokens 4-5 vs 4-7
    assert first.output_length == 7 and first.cached_tokens == 3 and first.upstream == "u0"
    assert first.model == "m" and first.ttft_s is not None and first.ttft_s > 0.0
    assert first.session_id == KeyedIds(SECRET, 4).session("s1")


def test_a_full_queue_drops_and_counts_never_blocks(tmp_path: Path) -> None:
    """With the writer not draining, submits past the queue size return at once, counted."""
    recorder = TraceRecorder(RecorderSettings(tmp_path, SECRET, queue_size=2))
    results = [recorder.submit(finished([1, 2, 3])) for _ in range(5)]
    assert results == [True, True, False, False, False] and recorder.dropped == 3


def record_rotated(directory: Path) -> TraceRecorder:
    """40 requests of 30 tokens recorded into ``directory`` in files of at most 1,024 bytes."""
    recorder = TraceRecorder(RecorderSettings(directory, SECRET, block=4, max_bytes=1024,
                                              reorder_s=0.0))
    recorder.start()
    for i in range(40):
        recorder.submit(finished(list(range(i, i + 30))))
    recorder.close()
    return recorder


def test_files_rotate_by_size_and_timestamps_continue(tmp_path: Path) -> None:
    """Past max_bytes a new file starts; together they parse as one monotonic trace."""
    recorder = record_rotated(tmp_path)
    assert len(recorder.files) > 1 and recorder.written == 40
    assert all(p.stat().st_size <= 1024 for p in recorder.files)
    assert len(parse_trace_lines(read_trace(tmp_path), block=4)) == 40


def test_recorded_trace_through_the_gateway_leaks_no_prompt_or_tenant(
    engines: list[Engine], gateway_factory: Callable[..., RunningGateway], tmp_path: Path
) -> None:
    """Canary strings in prompt, tenant name, API key and session id never reach the trace,
    while equal prompts still get equal ids and realized cached tokens are recorded."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('secret = "tenant-secret-0123456789"\n'
                       '[keys]\n"sk-CANARYKEY-77" = "CANARYTENANT-88"\n')
    record_dir = tmp_path / "rec"
    gateway = gateway_factory(engines, policy="round_robin", tenants=str(tenants),
                              record_dir=str(record_dir), record_block_size=16,
                              record_reorder_s=0.0)
    prompt = "CANARYPROMPT-99 " + "the quick brown fox jumps over the lazy dog " * 12
    headers = {"authorization": "Bearer sk-CANARYKEY-77", "x-session-id": "CANARYSESSION-66"}
    with httpx.Client(timeout=10) as client:
        for _ in range(3):
            response = client.post(gateway.url + "/v1/completions", headers=headers,
                                   json={"model": "sim", "prompt": prompt, "max_tokens": 4})
            assert response.status_code == 200
    salt = gateway.gateway.tenants.authenticate("Bearer sk-CANARYKEY-77").cache_salt  # type: ignore[union-attr]
    deadline = time.monotonic() + 10
    while 'kvreuse_gateway_trace_records_total{outcome="written"} 3.0' not in (
            metrics := httpx.get(gateway.url + "/metrics").text):
        assert time.monotonic() < deadline, metrics
        time.sleep(0.05)
    assert 'kvreuse_gateway_trace_records_total{outcome="dropped"} 0.0' in metrics
    gateway.server.stop()
    text = "\n".join(read_trace(record_dir))
    for canary in ("CANARY", "quick brown", "sk-", salt, "tenant-secret"):
        assert canary not in text
    records = parse_trace_lines(text.splitlines(), block=16)
    assert len(records) == 3
    assert records[0].hash_ids == records[1].hash_ids == records[2].hash_ids
    assert records[0].tenant is not None and len(records[0].tenant) == 16
    assert records[2].cached_tokens is not None and records[2].cached_tokens > 0
    assert records[0].output_length == 4


def test_import_of_the_same_requests_gives_the_recorded_ids(
    engines: list[Engine], gateway_factory: Callable[..., RunningGateway], tmp_path: Path
) -> None:
    """`trace import` of a log of the requests a gateway recorded, with the gateway's secret,
    writes the same hash ids (one keyed-id scheme, one tokenization)."""
    from kvreuse.cli.main import main

    secret = tmp_path / "secret"
    secret.write_text("shared-secret-0123456789\n")
    record_dir = tmp_path / "rec"
    gateway = gateway_factory(engines, policy="round_robin", record_dir=str(record_dir),
                              record_secret_file=str(secret), record_block_size=16,
                              record_reorder_s=0.0)
    bodies = [{"model": "sim", "prompt": "shared prefix " * 20 + f"question {i}", "max_tokens": 2}
              for i in range(3)]
    with httpx.Client(timeout=10) as client:
        for body in bodies:
            assert client.post(gateway.url + "/v1/completions", json=body).status_code == 200
    gateway.server.stop()
    recorded = parse_trace_lines(read_trace(record_dir), block=16)
    log = tmp_path / "log.jsonl"
    log.write_text("".join(f'{{"timestamp": {i}, "body": {json.dumps(b)}}}\n'
                           for i, b in enumerate(bodies)))
    out = tmp_path / "imported.jsonl"
    assert main(["trace", "import", str(log), "--out", str(out), "--block-size", "16",
                 "--secret-file", str(secret)]) == 0
    imported = parse_trace_lines(out.read_text().splitlines(), block=16)
    assert [r.hash_ids for r in imported] == [r.hash_ids for r in recorded]


def test_an_unwritable_directory_is_a_startup_error(tmp_path: Path) -> None:
    """--record on a path under a file fails when the gateway is built, naming the flag."""
    import pytest

    from kvreuse.errors import ConfigError

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="--record"):
        TraceRecorder(RecorderSettings(blocker / "sub", SECRET))


def test_record_settings_come_from_the_toml_file(tmp_path: Path) -> None:
    """record_dir and record_block_size are read from the gateway's config file."""
    from kvreuse.gateway.config import load_config_file

    path = tmp_path / "gw.toml"
    path.write_text('[gateway]\nrecord_dir = "rec"\nrecord_block_size = 64\n'
                    '[[upstreams]]\nurl = "http://127.0.0.1:1"\n')
    config = load_config_file(path)
    assert config.record_dir == "rec" and config.record_block_size == 64


FULL_DISK_SCRIPT = """
import json, resource, signal, sys, time
from pathlib import Path

from kvreuse.gateway import recorder as rec
from kvreuse.gateway.telemetry import RequestRecord
from kvreuse.identity import CacheIdentity
from kvreuse.routing.base import RequestView
from kvreuse.tokens import pack

# Every file this process writes stops at 4 KiB with EFBIG, as a full disk stops it with ENOSPC.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
rec.RETRY_S = 0.3
recorder = rec.TraceRecorder(rec.RecorderSettings(Path(sys.argv[1]), b"0123456789abcdef-recorder",
                                                  block=4, reorder_s=0.0))
recorder.start()
for i in range(300):
    view = RequestView("r", pack(list(range(i, i + 40))), 40, CacheIdentity(), None, None)
    record = RequestRecord("r", "/v1/completions", time.perf_counter(), model="m",
                           upstream="u0", cached_tokens=3, status=200, view=view,
                           completion_tokens=7)
    record.first_byte = record.started + 0.01
    assert recorder.submit(record)
    time.sleep(0.01)
recorder.close()
print(json.dumps({"written": recorder.written, "failed": recorder.failed,
                  "dropped": recorder.dropped, "files": [str(p) for p in recorder.files],
                  "error": recorder.write_error}))
"""


def test_a_full_disk_loses_what_it_must_and_recording_resumes(tmp_path: Path) -> None:
    """Files that stop growing (RLIMIT_FSIZE, as a full disk): no traceback, every record
    written or counted failed, each file cut to whole lines, and a new file after the pause."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", FULL_DISK_SCRIPT, str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    outcome = json.loads(result.stdout)
    assert outcome["written"] + outcome["failed"] == 300 and outcome["dropped"] == 0
    assert outcome["failed"] > 0 and "File too large" in outcome["error"]
    assert len(outcome["files"]) >= 3  # it went on writing after each failure
    assert "trace recorder cannot write" in result.stderr
    records = parse_trace_lines(read_trace(tmp_path), block=4)  # whole lines, in order
    assert len(records) == outcome["written"]


def test_a_directory_removed_while_recording_is_made_again(tmp_path: Path) -> None:
    """The trace directory moved away between two files: the next file is written in a new
    one of the same name, nothing lost."""
    import shutil

    directory = tmp_path / "traces"
    recorder = TraceRecorder(RecorderSettings(directory, SECRET, block=4, max_bytes=1024,
                                              reorder_s=0.0))
    recorder.start()
    for i in range(10):
        recorder.submit(finished(list(range(i, i + 30))))
    time.sleep(0.6)  # written and flushed
    shutil.move(directory, tmp_path / "moved")
    for i in range(30):
        recorder.submit(finished(list(range(i, i + 30))))
    recorder.close()
    assert recorder.written == 40 and recorder.failed == 0
    kept = len(parse_trace_lines(read_trace(tmp_path / "moved"), block=4))
    assert kept + len(parse_trace_lines(read_trace(directory), block=4)) == 40


def record_two_gateways(directory: Path) -> tuple[TraceRecorder, TraceRecorder]:
    """Two recorders into one directory, the second's clock 100 s ahead (a gateway started
    100 s later): first, second, first again."""
    first = TraceRecorder(RecorderSettings(directory, SECRET, block=4, reorder_s=0.0))
    second = TraceRecorder(RecorderSettings(directory, SECRET, block=4, reorder_s=0.0),
                           wall_clock=lambda: time.time() + 100.0)
    first.start()
    second.start()
    first.submit(finished(list(range(8))))
    second.submit(finished(list(range(12))))
    time.sleep(0.05)
    first.submit(finished(list(range(16))))
    first.close()
    second.close()
    return first, second


def test_two_gateways_recordings_merge_onto_one_clock(tmp_path: Path) -> None:
    """Two recordings in one directory are no trace as they are (each clock starts at 0);
    `kvreuse trace merge` puts the second 100 s on, after the first's requests."""

    record_two_gateways(tmp_path / "rec")
    with pytest.raises(InputFormatError, match="goes back in time"):
        parse_trace_lines(read_trace(tmp_path / "rec"), block=4)
    out = tmp_path / "merged.jsonl"
    assert main(["trace", "merge", str(tmp_path / "rec"), "--out", str(out),
                 "--block-size", "4"]) == 0
    merged = parse_trace_lines(out.read_text().splitlines(), block=4)
    assert [r.input_length for r in merged] == [8, 16, 12]
    assert merged[1].timestamp_ms < 1000.0
    assert abs(merged[2].timestamp_ms - 100_000.0) < 1000.0
    assert main(["trace", "stats", str(out), "--block-size", "4", "--replicas", "1"]) == 0


def test_merging_one_recording_gives_its_files_joined(tmp_path: Path) -> None:
    """One recording rotated over several files merges into exactly its files end to end."""
    recorder = record_rotated(tmp_path / "rec")
    assert len(recorder.files) > 1
    out = tmp_path / "merged.jsonl"
    assert main(["trace", "merge", *map(str, reversed(recorder.files)), "--out", str(out),
                 "--block-size", "4"]) == 0
    assert out.read_text().splitlines() == read_trace(tmp_path / "rec")


def test_merge_refuses_files_of_unknown_clock_and_directories_elsewhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file not named by the recorder is refused by name; a recording directory given to a
    command that wants one trace says how to merge it."""

    record_two_gateways(tmp_path / "rec")
    stray = tmp_path / "rec" / "trace-mine.jsonl"
    stray.write_text("")
    assert main(["trace", "merge", str(tmp_path / "rec"), str(stray), "--out",
                 str(tmp_path / "m.jsonl")]) == 1
    err = capsys.readouterr().err
    assert "trace-mine.jsonl" in err and "merge recorded files only" in err
    stray.unlink()
    for command in (["simulate", "--trace", str(tmp_path / "rec"), "--cache-tokens", "1000"],
                    ["plan", "--trace", str(tmp_path / "rec"), "--slo", "ttft_p95=1"],
                    ["trace", "stats", str(tmp_path / "rec")],
                    ["replay", "--trace", str(tmp_path / "rec"), "--target", "http://h:1"]):
        assert main(command) == 1
        err = capsys.readouterr().err
        assert f"kvreuse trace merge {tmp_path / 'rec'} --out" in err, command
    assert not (tmp_path / "m.jsonl").exists()


def test_a_missing_part_is_noted_and_a_file_named_twice_counts_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Part 2 of a rotated recording deleted: the merge says which part is missing; the
    directory and one of its files named again merge each request once."""
    recorder = record_rotated(tmp_path / "rec")
    assert len(recorder.files) >= 3
    kept = len(read_trace(tmp_path / "rec")) - len(recorder.files[1].read_text().splitlines())
    recorder.files[1].unlink()
    out = tmp_path / "merged.jsonl"
    again = tmp_path / "rec" / ".." / "rec" / recorder.files[0].name
    assert main(["trace", "merge", str(tmp_path / "rec"), str(again), "--out", str(out),
                 "--block-size", "4"]) == 0
    printed = capsys.readouterr().out
    assert "part 2 of the recording is missing" in printed
    assert len(out.read_text().splitlines()) == kept


def test_a_line_still_being_written_is_left_out_with_a_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A recording whose gateway is mid-write ends in half a line: the merge leaves that line
    out, says so, and keeps every whole one."""
    recorder = record_rotated(tmp_path / "rec")
    last = recorder.files[-1]
    whole = last.read_text()
    last.write_text(whole + whole.splitlines()[0][:25])
    out = tmp_path / "merged.jsonl"
    assert main(["trace", "merge", str(tmp_path / "rec"), "--out", str(out),
                 "--block-size", "4"]) == 0
    assert f"the last line of {last} is not finished" in capsys.readouterr().out
    assert len(out.read_text().splitlines()) == 40
