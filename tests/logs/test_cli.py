"""`python -m engine.logs summary`: the tables, --json, warnings on stderr, exit statuses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from engine.logs.__main__ import main
from engine.logs.summary import Summary
from tests.logs.scenario import write_scenario


def test_summary_prints_every_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "node.jsonl"
    write_scenario(path)
    assert main(["summary", str(path)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    out = captured.out
    assert (
        "requests: 8 arrived (8 seen); finished 0 stop, 6 length; 1 cancelled (cancel_op 1); 1 failed; "
        "0 queued and 0 running when the log ends" in out
    )
    for title in (
        "latency (requests that finished with stop or length)",
        "transfers (finished; rounds that carried data)",
        "time per replica state",
        "lock periods (accepting no new KV migrations)",
        "network flow (bytes, from transfer rounds)",
        "network flow (bytes, from the controller's reports)",
        "errors by code",
    ):
        assert f"\n{title}\n" in out
    lines = out.splitlines()
    assert any(line.split()[:6] == ["embedding", "inproc", "3", "3", "0", "1:1"] for line in lines)
    assert any(line.split()[:3] == ["transfer_timeout", "1", "kv"] for line in lines)
    assert any(line.split()[:2] == ["decode-1", "ShuttingNull"] for line in lines)
    assert any(line.split()[:4] == ["decode-1", "1", "53.70", "ms"] for line in lines)  # the lock


def test_summary_json_is_the_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "node.jsonl"
    write_scenario(path)
    assert main(["summary", str(path), "--json"]) == 0
    summary = msgspec.json.decode(capsys.readouterr().out, type=Summary)
    assert summary.requests.arrived == 8
    assert [row.phase for row in summary.latency][-1] == "e2e"


def test_warnings_go_to_stderr_and_the_summary_still_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "node.jsonl"
    write_scenario(path)
    with path.open("ab") as handle:
        handle.write(b"hello there\n")
        handle.write(b'{"event":"request_arri')
    assert main(["summary", str(path)]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"warning: {path}: the last line is cut off after 22 bytes (the writer stopped mid-line, e.g. a crash); "
        "read the 132 events before it",
        f"warning: {path}: skipped 1 line(s) that are not events (e.g. line 133: JSON is malformed: invalid "
        "character (byte 0))",
    ]
    assert "requests: 8 arrived" in captured.out


def test_logs_without_events_or_missing_fail_with_status_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    assert main(["summary", str(empty)]) == 1
    assert capsys.readouterr().err == (
        f"warning: {empty}: no events found\npython -m engine.logs: no events in {empty}\n"
    )
    assert main(["summary", str(tmp_path / "missing.jsonl")]) == 1
    assert capsys.readouterr().err == (
        f"python -m engine.logs: cannot read log '{tmp_path / 'missing.jsonl'}': No such file or directory\n"
    )


def test_the_module_runs_as_a_program(tmp_path: Path) -> None:
    path = tmp_path / "node.jsonl"
    write_scenario(path)
    done = subprocess.run(
        [sys.executable, "-m", "engine.logs", "summary", str(path), "--json"],
        capture_output=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert msgspec.json.decode(done.stdout, type=Summary).requests.arrived == 8
    usage = subprocess.run(
        [sys.executable, "-m", "engine.logs", "request", str(path)],
        capture_output=True,
        check=False,
        timeout=60,
    )
    assert usage.returncode == 2
    assert b"the following arguments are required: --id" in usage.stderr


def test_the_summary_examples_in_the_docs_are_what_the_command_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "logs.md").read_text()
    section = docs[docs.index("## `summary`") : docs.index("## `timeline`")]
    examples = section.split("```")[1::2]
    assert len(examples) == 7
    path = tmp_path / "node.jsonl"
    write_scenario(path)
    assert main(["summary", str(path)]) == 0
    printed = capsys.readouterr().out.splitlines()
    for example in examples:
        for line in example.strip("\n").splitlines():
            if not line.startswith(("logs: ", "from ")):
                assert line in printed, line
