"""One request's events in order, with durations, and how ids are looked up."""

from __future__ import annotations

import itertools
from pathlib import Path

import msgspec
import pytest

from engine.logs.__main__ import main
from engine.logs.reader import read_entries
from engine.logs.request import RequestNotFound, RequestReport, find_request, request_report
from tests.logs.scenario import write_scenario


def test_a_requests_events_in_order_with_the_duration_of_each_phase(tmp_path: Path) -> None:
    path = tmp_path / "node.jsonl"
    write_scenario(path)
    entries, _ = read_entries([path])
    report = request_report(entries, "r2")
    assert [row.event for row in report.events] == [
        "request_arrived",
        "request_queued",
        "encode_started",
        "encode_finished",
        "transfer_started",
        "transfer_round",
        "transfer_round",
        "transfer_round",
        "transfer_finished",
        "transfer_finished",
        "request_queued",
        "prefill_started",
        "prefill_finished",
        "first_token",
        "transfer_started",
        "transfer_round",
        "transfer_finished",
        "request_queued",
        "request_finished",
    ]
    assert report.outcome == "length"
    assert report.transfers == ["r-embedding-2", "r-kv-3"]
    took = {row.event: row.took for row in report.events if row.took is not None}
    assert took["encode_finished"] == pytest.approx(0.006, abs=1e-6)
    assert took["prefill_finished"] == pytest.approx(0.010, abs=1e-6)
    assert took["request_finished"] == pytest.approx(report.timings.e2e_s)
    assert took["first_token"] == pytest.approx(report.timings.ttft_s)
    rows = report.events
    assert rows[0].at == rows[0].since_previous == 0.0
    for before, after in itertools.pairwise(rows):
        assert after.at == pytest.approx(before.at + after.since_previous)
    assert rows[5].fields["round"] == 0 and rows[5].replica == "encode-0"
    assert report.timings.encode_s == pytest.approx(0.006, abs=1e-6)


def test_ids_are_found_exactly_or_by_a_unique_prefix(tmp_path: Path) -> None:
    path = tmp_path / "node.jsonl"
    write_scenario(path, prefix="req-")
    entries, _ = read_entries([path])
    assert find_request(entries, "req-3") == "req-3"
    with pytest.raises(
        RequestNotFound,
        match=r"^request id prefix 'req-' matches 8 requests \(req-1, req-2, req-3, req-4, req-5, \.\.\.\); give more of it$",
    ):
        find_request(entries, "req-")
    with pytest.raises(
        RequestNotFound,
        match=r"^no request 'zzz' in the logs \(8 requests, e.g. req-1, req-2, req-3, req-4, req-5, \.\.\.\)$",
    ):
        find_request(entries, "zzz")


def test_request_command_prints_the_events_and_the_breakdown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "node.jsonl"
    write_scenario(path, prefix="abc")
    assert main(["request", str(path), "--id", "abc6"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("request abc6: 8 events from 2026-09-21 14:13:20.")
    assert "outcome failed" in out.splitlines()[0]
    assert "code=transfer_timeout message=kv transfer timed out" in out
    assert "status=failed reason=no progress for 30.0 s rounds=0" in out
    assert "latency breakdown" in out
    assert main(["request", str(path), "--id", "abc1", "--json"]) == 0
    report = msgspec.json.decode(capsys.readouterr().out, type=RequestReport)
    assert report.request_id == "abc1" and report.outcome == "length"
    assert main(["request", str(path), "--id", "nope"]) == 1
    assert capsys.readouterr().err.startswith(
        "python -m engine.logs: no request 'nope' in the logs (8 requests"
    )
