"""`kvreuse fingerprint`, `diff`, `audit` and `fixtures` end to end on real templates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvreuse.cli.main import main

TEMPLATES = Path(__file__).parents[1] / "data" / "templates"
QWEN = str(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja")
POLICY = "Refunds are possible within 30 days. Shipping is free above 25 EUR. " * 20
TOOLS = [
    {"type": "function", "function": {"name": "lookup", "description": "Find an order",
     "parameters": {"type": "object", "properties": {"id": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "refund", "description": "Refund an order",
     "parameters": {"type": "object", "properties": {"id": {"type": "string"}}}}},
]


def write(path: Path, system: str, user: str, tools: Any = None) -> str:
    body: dict[str, Any] = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]
    }
    if tools is not None:
        body["tools"] = tools
    path.write_text(json.dumps(body))
    return str(path)


def common(template: str = QWEN) -> list[str]:
    return ["--tokenizer", "o200k_base", "--template", template, "--now", "2025-01-30T09:00:00"]


def test_fingerprint_prints_json_without_prompt_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One JSON line per request; two requests differing in the question share it."""
    a = write(tmp_path / "a.json", POLICY, "Where is my order?")
    b = write(tmp_path / "b.json", POLICY, "Can I get a refund?")
    code = main(["fingerprint", a, b, *common(), "--tokens", "256", "--model-revision", "m@1"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0
    assert [line["source"] for line in lines] == [a, b]
    assert lines[0]["fingerprint"] == lines[1]["fingerprint"]
    assert lines[0]["tokens"] == 256 and lines[0]["model_revision"] == "m@1"
    assert "Refunds" not in json.dumps(lines)


def test_diff_reports_token_offset_field_and_reuse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """JSON diff: first divergent token, its field, and reuse under each rule."""
    a = write(tmp_path / "a.json", "Today is 2025-01-30. " + POLICY, "hi")
    b = write(tmp_path / "b.json", "Today is 2025-01-31. " + POLICY, "hi")
    assert main(["diff", a, b, *common(), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["field_path"] == "messages[0].content"
    assert result["first_divergent_token"] == result["shared_tokens"]
    assert result["reuse"]["radix"]["reused"] == result["shared_tokens"]
    assert result["reuse"]["vllm"]["reused"] == result["shared_tokens"] // 16 * 16
    assert result["reuse"]["openai"]["reused"] == 0
    assert result["char_offset_a"] > 0


def test_diff_text_output_names_the_caches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Text diff prints a row per cache rule."""
    a = write(tmp_path / "a.json", POLICY, "Where is my order?")
    b = write(tmp_path / "b.json", POLICY, "Refund?")
    assert main(["diff", a, b, *common()]) == 0
    out = capsys.readouterr().out
    assert "field: messages[1].content" in out
    assert "vLLM blocks of 16" in out and "OpenAI-style" in out


def test_audit_fail_on_and_formats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Findings at or above --fail-on exit 1; --fail-on never exits 0; SARIF and JSON parse."""
    a = write(tmp_path / "a.json", POLICY, "a", tools=TOOLS)
    b = write(tmp_path / "b.json", POLICY, "b", tools=list(reversed(TOOLS)))
    assert main(["audit", a, b, *common()]) == 1
    assert "KV104" in capsys.readouterr().out
    assert main(["audit", a, b, *common(), "--format", "sarif", "--fail-on", "never"]) == 0
    sarif = json.loads(capsys.readouterr().out)
    assert sarif["runs"][0]["results"][0]["ruleId"] == "KV104"
    out_file = tmp_path / "report.json"
    assert main(["audit", a, b, *common(), "--format", "json", "--output", str(out_file)]) == 1
    assert json.loads(out_file.read_text())["findings"][0]["rule"] == "KV104"


def test_audit_clean_prompts_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Stable prompts: no findings, exit 0 even with --fail-on note."""
    a = write(tmp_path / "a.json", POLICY, "a", tools=TOOLS)
    b = write(tmp_path / "b.json", POLICY, "b", tools=TOOLS)
    assert main(["audit", a, b, *common(), "--fail-on", "note"]) == 0
    assert "no findings" in capsys.readouterr().out


def test_audit_reads_logged_requests_jsonl(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A .jsonl of logged request bodies (wrapped or not) is audited line by line."""
    log = tmp_path / "requests.jsonl"
    bodies = [
        {"body": {"messages": [{"role": "system", "content": f"id {uid}. {POLICY}"},
                               {"role": "user", "content": "hi"}]}}
        for uid in ("3f2b8a1e-9c4d-4e5f-8a7b-1c2d3e4f5a6b", "7d9e0f1a-2b3c-4d5e-9f6a-7b8c9d0e1f2a")
    ]
    log.write_text("\n".join(json.dumps(b) for b in bodies) + "\n")
    assert main(["audit", str(log), *common(), "--format", "json"]) == 1
    findings = json.loads(capsys.readouterr().out)["findings"]
    assert findings[0]["rule"] == "KV102"
    assert findings[0]["location"] == f"{log}:1: messages[0].content"


def test_bad_request_file_names_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A broken .jsonl line is reported with file and line, exit 1."""
    log = tmp_path / "bad.jsonl"
    log.write_text('{"messages": []}\n{not json\n')
    assert main(["audit", str(log), *common()]) == 1
    assert f"{log}:2" in capsys.readouterr().err


def test_chat_request_without_template_says_what_to_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A named tokenizer has no template: the error tells the user to pass --template."""
    a = write(tmp_path / "a.json", POLICY, "hi")
    assert main(["fingerprint", a, "--tokenizer", "o200k_base"]) == 1
    assert "--template" in capsys.readouterr().err


def test_fixtures_record_then_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """check passes right after record; a template edit is reported with its cold-cache cost."""
    fixture = write(tmp_path / "f.json", POLICY, "Where is my order?")
    golden = str(tmp_path / "golden.json")
    assert main(["fixtures", "record", fixture, "--golden", golden, *common()]) == 0
    assert main(["fixtures", "check", fixture, "--golden", golden, *common()]) == 0
    out = capsys.readouterr().out
    assert f"{fixture}: same" in out
    assert out.count(": ok (") == 3
    edited = tmp_path / "edited.jinja"
    edited.write_text("<|system|>" + Path(QWEN).read_text())
    args = ["fixtures", "check", fixture, "--golden", golden, *common(str(edited))]
    assert main([*args, "--json", "--rps", "20", "--prefixes", "10", "--replicas", "4"]) == 1
    report = json.loads(capsys.readouterr().out)
    changed = report["fixtures"][0]
    assert changed["status"] == "changed"
    assert changed["changed_revisions"] == ["template"]
    assert changed["first_changed_block"] == 0
    assert changed["reused_after"] == 0
    assert changed["cold_cache"]["cold_copies"] == 40
    assert all(p["ok"] for p in report["probes"][fixture])
