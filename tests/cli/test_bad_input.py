"""Bad input to the offline tools: a clear error naming the file, line, field or flag and a
non-zero exit, never a traceback. Cases run the CLI's ``main`` in-process (an exception
escaping it fails the test as a traceback would); a few run a child process as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvreuse.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
CONFIG = EXAMPLES / "capacity" / "llama-8b-config.json"
PROMPT = ["--tokenizer", "o200k_base", "--template", "chatml"]


def run_main(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, cwd: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    """``main(args)`` in ``cwd``; usage errors (argparse's exit 2) count as an exit code."""
    monkeypatch.chdir(cwd)
    try:
        code = main(list(args))
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out, err)


def kvreuse(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The command in a child process whose stdout is a pipe."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-c", "import sys; from kvreuse.cli.main import main; sys.exit(main())",
         *args],
        capture_output=True, text=True, env=env, cwd=cwd, timeout=120, check=False,
    )


def assert_clear_error(done: subprocess.CompletedProcess[str], *names: str) -> None:
    """Non-zero exit, no traceback, and the error names every one of ``names``."""
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    for name in names:
        assert name in done.stderr, (name, done.stderr)


BAD_REQUESTS: dict[str, tuple[bytes, str]] = {
    "utf8.json": (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "not valid UTF-8"),
    "surrogate.json": (
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        "messages[0].content: a string holds a lone UTF-16 surrogate",
    ),
    "deep.json": (b"[" * 5000 + b"]" * 5000, "nested too deeply"),
    "bigint.json": (
        b'{"messages": [{"role": "user", "content": "hi"}], "seed": ' + b"7" * 5000 + b"}",
        "an integer of 5,000 digits",
    ),
    "lines.jsonl": (
        b'{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": [1,\n',
        "lines.jsonl:2: not valid JSON",
    ),
}


@pytest.mark.parametrize("command", ["fingerprint", "audit", "diff"])
@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_prompt_tools_name_the_file_and_problem(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    command: str, name: str,
) -> None:
    """fingerprint, audit and diff on invalid Unicode, deep nesting, 5,000-digit integers and a
    broken JSONL line: exit 1 naming the file (and line or field) and what is wrong."""
    data, problem = BAD_REQUESTS[name]
    (tmp_path / name).write_bytes(data)
    files = [name, name] if command == "diff" else [name]
    done = run_main(capsys, monkeypatch, tmp_path, command, *files, *PROMPT)
    assert_clear_error(done, name, problem)


def test_a_child_process_shows_no_traceback_either(tmp_path: Path) -> None:
    """The same through a real process and pipe: one line of error, exit 1."""
    data, problem = BAD_REQUESTS["deep.json"]
    (tmp_path / "deep.json").write_bytes(data)
    done = kvreuse("audit", "deep.json", *PROMPT, cwd=tmp_path)
    assert_clear_error(done, "deep.json", problem)
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1


def test_a_directory_given_as_a_request_file_says_so(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A directory is "is a directory", not "no such file"."""
    (tmp_path / "requests").mkdir()
    done = run_main(capsys, monkeypatch, tmp_path, "fingerprint", "requests", *PROMPT)
    assert_clear_error(done, "requests: is a directory")


def test_a_template_that_is_not_utf8_names_the_template(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """--template with bytes that are not UTF-8: the file and the byte, no traceback."""
    (tmp_path / "t.jinja").write_bytes(b"{{ messages }}\xff")
    (tmp_path / "r.json").write_text('{"messages": [{"role": "user", "content": "hi"}]}')
    done = run_main(capsys, monkeypatch, tmp_path, "fingerprint", "r.json", "--tokenizer",
                    "o200k_base", "--template", "t.jinja")
    assert_clear_error(done, "t.jinja", "not valid UTF-8")


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--kv-pool-gib", "-5"], ["--kv-pool-gib", "must be > 0, got -5"]),
        (["--kv-pool-gib", "nan"], ["--kv-pool-gib", "finite"]),
        (["--kv-pool-gib", "40", "--replicas", "0"], ["--replicas", "must be >= 1, got 0"]),
        (["--gpu-memory-gib", "80", "--weights-gib", "16", "--utilisation", "1.5"],
         ["--utilisation", "(0, 1]"]),
        (["--kv-pool-gib", "40", "--pinned-gib", "-1"], ["--pinned-gib", ">= 0"]),
        (["--kv-pool-gib", "40", "--gpus", "0"], ["--gpus", ">= 1"]),
        (["--kv-pool-gib", "40", "--workload", "."], ["--workload .: is a directory"]),
        (["--kv-pool-gib", "40", "--trace", "."], ["--trace .: is a directory"]),
        (["--kv-pool-gib", "40", "--trace", "missing.jsonl"], ["--trace missing.jsonl: no such"]),
        (["--kv-pool-gib", "1e300"], ["--kv-pool-gib", "at most 1,048,576"]),
        (["--kv-pool-gib", "40", "--replicas", "1" + "0" * 20], ["--replicas", "at most"]),
        (["--kv-pool-gib", "40", "--pinned-gib", "50", "--workload",
          str(EXAMPLES / "capacity" / "contract-library.json")], ["--pinned-gib", "no idle cache"]),
    ],
)
def test_capacity_flags_are_checked(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    flags: list[str], names: list[str],
) -> None:
    """Negative sizes, a fleet of zero, a utilisation over 1, directories: each names its flag."""
    done = run_main(capsys, monkeypatch, tmp_path, "capacity", "--config", str(CONFIG), *flags)
    assert_clear_error(done, *names)


@pytest.mark.parametrize(
    ("group", "problem"),
    [('{"count": 1e308, "tokens": 100}', "'count' is 1e+308; at most 1e+15"),
     ('{"count": 5, "tokens": 100, "hot_count": 10}', "'hot_count' (10) is more than 'count'")],
)
def test_capacity_workload_values_are_checked(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    group: str, problem: str,
) -> None:
    """Absurd or contradictory workload numbers name the file and the field, no overflow."""
    (tmp_path / "w.json").write_text('{"prefix_groups": [' + group + "]}")
    done = run_main(capsys, monkeypatch, tmp_path, "capacity", "--config", str(CONFIG),
                    "--kv-pool-gib", "40", "--workload", "w.json")
    assert_clear_error(done, "w.json: prefix_groups[0]", problem)


def test_capacity_config_that_is_a_directory_or_malformed(tmp_path: Path) -> None:
    """--config DIR says it is a directory; a config nested 5,000 deep names the file (in a
    child process, as a user runs it)."""
    assert_clear_error(kvreuse("capacity", "--config", ".", cwd=tmp_path),
                       "--config .: is a directory")
    (tmp_path / "config.json").write_bytes(b"[" * 5000 + b"]" * 5000)
    assert_clear_error(kvreuse("capacity", "--config", "config.json", cwd=tmp_path),
                       "config.json", "nested too deeply")


def test_simulate_rejects_a_bad_policy_spec_and_scale(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An unclosed bracket, a --scale that is not a positive finite number up to 100 and a NaN
    lag name the flag (a NaN scale used to hang)."""
    done = run_main(capsys, monkeypatch, tmp_path, "simulate", "--scenario", "six-turn",
                    "--policy", "prefix_hash[overload=None")
    assert_clear_error(done, "--policy")
    for scale in ("0", "nan", "inf", "1000"):
        done = run_main(capsys, monkeypatch, tmp_path, "simulate", "--scenario", "six-turn",
                        "--scale", scale)
        assert_clear_error(done, "--scale")
    done = run_main(capsys, monkeypatch, tmp_path, "simulate", "--scenario", "six-turn",
                    "--kv-lag", "nan")
    assert_clear_error(done, "--kv-lag", "finite")


def test_simulate_json_to_a_directory_names_the_flag(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """--json pointing at a directory: an error naming --json, not a traceback."""
    (tmp_path / "out").mkdir()
    done = run_main(capsys, monkeypatch, tmp_path, "simulate", "--scenario", "six-turn",
                    "--json", "out")
    assert done.returncode == 2
    assert_clear_error(done, "argument --json", "'out' is a directory")



def test_an_empty_output_path_is_refused_as_empty(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--json ""`` (an unset shell variable) says the path is empty, not that it is a
    directory."""
    done = run_main(capsys, monkeypatch, tmp_path, "simulate", "--scenario", "six-turn",
                    "--json", "")
    assert done.returncode == 2
    assert_clear_error(done, "argument --json", "an empty path; give a file")

@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["fingerprint", str(EXAMPLES / "prompts" / "stable-a.json"), *PROMPT,
          "--block-size", "0"], "--block-size"),
        (["fixtures", "check", str(EXAMPLES / "prompts" / "stable-a.json"), "--golden", "g.json",
          *PROMPT, "--rps", "nan"], "--rps"),
        (["fixtures", "check", str(EXAMPLES / "prompts" / "stable-a.json"), "--golden", "g.json",
          *PROMPT, "--replicas", "0"], "--replicas"),
        (["hitrate", "http://127.0.0.1:9/metrics", "--count", "0"], "--count"),
        (["hitrate", "http://127.0.0.1:9/metrics", "--window", "-1"], "--window"),
    ],
)
def test_flags_out_of_range_name_the_flag(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    args: list[str], flag: str,
) -> None:
    """A zero block size, a NaN rate, no replicas, no rounds, a negative window: the argument
    parser refuses them (exit 2) naming the flag."""
    done = run_main(capsys, monkeypatch, tmp_path, *args)
    assert done.returncode == 2
    assert_clear_error(done, f"argument {flag}")


TRACE_ARGS = ["--trace", "t.jsonl"]


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["simulate", "--scenario", "six-turn"], "--json"),
        (["simulate", "--scenario", "six-turn"], "--report"),
        (["plan", *TRACE_ARGS, "--slo", "ttft_p95=1"], "--json"),
        (["plan", *TRACE_ARGS, "--slo", "ttft_p95=1"], "--report"),
        (["replay", *TRACE_ARGS, "--target", "http://127.0.0.1:9"], "--json"),
        (["replay", *TRACE_ARGS, "--target", "http://127.0.0.1:9"], "--report"),
        (["trace", "stats", "t.jsonl"], "--json"),
        (["trace", "stats", "t.jsonl"], "--report"),
        (["trace", "merge", "recorded"], "--out"),
        (["trace", "import", "log.jsonl"], "--out"),
        (["audit", str(EXAMPLES / "prompts" / "stable-a.json"), *PROMPT], "--output"),
    ],
)
def test_an_output_in_a_missing_directory_is_refused_before_any_work(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    args: list[str], flag: str,
) -> None:
    """Every file a command writes is checked as its flag is read: a plan or a replay of an
    hour must not fail at its last step on a directory that was never there."""
    done = run_main(capsys, monkeypatch, tmp_path, *args, flag, "missing/out.file")
    assert done.returncode == 2
    assert_clear_error(done, f"argument {flag}", "the directory missing does not exist")


def _on_a_full_disk(*args: str, cwd: Path, stdout: int | None = None
                    ) -> subprocess.CompletedProcess[str]:
    """The command in a child process that may write files of 256 bytes at most: a full disk as
    the write sees it (EFBIG, as ENOSPC; Python ignores SIGXFSZ). Its stdout is ``stdout`` (a
    file descriptor) or a pipe."""
    import resource

    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-c", "import sys; from kvreuse.cli.main import main; sys.exit(main())",
         *args],
        stdout=subprocess.PIPE if stdout is None else stdout, stderr=subprocess.PIPE,
        text=True, env=env, cwd=cwd, timeout=120, check=False,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (256, 256)),
    )


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["trace", "stats", "t.jsonl", "--replicas", "1", "--json"], "--json"),
        (["simulate", "--scenario", "six-turn", "--json"], "--json"),
        (["audit", str(EXAMPLES / "prompts" / "logged-requests.jsonl"), "--tokenizer",
          "o200k_base", "--template", str(EXAMPLES / "prompts" / "qwen2.5-chat-template.jinja"),
          "--format", "sarif", "--output"], "--output"),
    ],
)
def test_a_full_disk_is_an_error_naming_the_flag_and_the_earlier_file_stays(
    tmp_path: Path, args: list[str], flag: str
) -> None:
    """No traceback and no partial file beside the output; what it replaced is intact."""
    from kvreuse.testing.mooncake import synthetic_mooncake

    (tmp_path / "t.jsonl").write_text("\n".join(synthetic_mooncake(requests=30, documents=2))
                                      + "\n")
    (tmp_path / "out.json").write_text("earlier\n")
    done = _on_a_full_disk(*args, "out.json", cwd=tmp_path)
    assert_clear_error(done, f"{flag} out.json: cannot write: File too large")
    assert (tmp_path / "out.json").read_text() == "earlier\n"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


STDOUT_COMMANDS = [
    ["trace", "stats", "t.jsonl", "--replicas", "1"],
    ["simulate", "--scenario", "six-turn"],
    ["scenarios"],
]


def _small_trace(directory: Path) -> None:
    from kvreuse.testing.mooncake import synthetic_mooncake

    (directory / "t.jsonl").write_text(
        "\n".join(synthetic_mooncake(requests=30, documents=2)) + "\n")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="/dev/full is Linux's")
@pytest.mark.parametrize("args", STDOUT_COMMANDS, ids=lambda args: args[0])
def test_a_full_disk_under_stdout_is_one_line_naming_standard_output(
    tmp_path: Path, args: list[str]
) -> None:
    """`kvreuse ... > out.txt` on a full disk (``/dev/full``: every write fails with ENOSPC):
    exit 1 and one line, not rich's traceback."""
    _small_trace(tmp_path)
    with open("/dev/full", "w") as full:
        done = _on_a_full_disk(*args, cwd=tmp_path, stdout=full.fileno())
    assert done.returncode == 1
    assert_clear_error(done, "cannot write standard output: No space left on device")
    assert "Exception ignored" not in done.stderr, done.stderr


@pytest.mark.parametrize("args", STDOUT_COMMANDS, ids=lambda args: args[0])
def test_a_reader_gone_before_the_first_line_ends_the_command_quietly(
    tmp_path: Path, args: list[str]
) -> None:
    """`kvreuse ... | head` with the reader gone: exit 1 and nothing on stderr (no traceback,
    no "Exception ignored" as the interpreter exits)."""
    _small_trace(tmp_path)
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = _on_a_full_disk(*args, cwd=tmp_path, stdout=write_end)
    finally:
        os.close(write_end)
    assert done.returncode == 1
    assert done.stderr == ""


def test_an_error_with_stderr_lost_is_still_exit_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A command failing while stderr fails too returns its exit code instead of raising."""

    class Lost:
        def write(self, text: str) -> int:
            raise OSError(28, "No space left on device")

        def flush(self) -> None:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(sys, "stderr", Lost())
    monkeypatch.chdir(tmp_path)
    assert main(["trace", "stats", "missing.jsonl"]) == 1
