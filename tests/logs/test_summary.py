"""The summary of realistic logs written through the real writer: counts match what was emitted."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.logs.aggregate import Aggregator
from engine.logs.reader import read_entries
from engine.logs.summary import Summary, percentile, summarize
from tests.logs.scenario import START_TS, Expected, write_scenario


def _summary(paths: list[Path], *, label_logs: bool = False) -> Summary:
    entries, logs = read_entries(paths, label_logs=label_logs)
    aggregator = Aggregator()
    for entry in entries:
        aggregator.add(entry.event)
    return summarize(aggregator, logs=logs.stats, warnings=logs.warnings())


def _rounds(summary: Summary, kind: str) -> Counter[int]:
    found: Counter[int] = Counter()
    for row in summary.transfers:
        if row.kind == kind:
            found.update(row.rounds)
    return found


def _check_counts(summary: Summary, expected: Expected, copies: int = 1) -> None:
    requests = summary.requests
    assert requests.arrived == requests.seen == expected.requests * copies
    assert requests.finished_length == expected.outcomes["length"] * copies
    assert requests.finished_stop == 0
    assert requests.cancelled == expected.outcomes["cancelled"] * copies
    assert requests.failed == expected.outcomes["failed"] * copies
    assert requests.queued == requests.running == 0
    assert requests.generated_tokens == expected.generated_tokens * copies
    for kind in ("embedding", "kv"):
        assert _rounds(summary, kind) == Counter({r: n * copies for r, n in expected.rounds[kind].items()})
        assert sum(row.bytes for row in summary.transfers if row.kind == kind) == (
            expected.transfer_bytes[kind] * copies
        )
    assert sum(row.failed for row in summary.transfers) == expected.failed_transfers * copies
    assert {row.code: row.count for row in summary.errors} == {
        code: count * copies for code, count in expected.errors.items()
    }


def test_summary_counts_match_what_the_log_holds(tmp_path: Path) -> None:
    path = tmp_path / "node.jsonl"
    expected = write_scenario(path)
    summary = _summary([path])
    assert summary.warnings == []
    _check_counts(summary, expected)
    # Both sides logged each embedding transfer's end: counted once.
    assert [(row.kind, row.count, row.succeeded) for row in summary.transfers] == [
        ("embedding", 3, 3),
        ("kv", 8, 7),
    ]
    assert summary.transfer_failures == {"no progress for 30.0 s": 1}
    assert summary.unfinished_transfers == 0
    assert {(row.source, row.destination): row.bytes for row in summary.flows} == expected.flows
    assert summary.requests.cancel_reasons == {"cancel_op": 1}
    assert summary.problems == []
    assert summary.span_s == pytest.approx(expected.end_ts - START_TS)


def test_latency_rows_cover_the_requests_that_finished(tmp_path: Path) -> None:
    path = tmp_path / "node.jsonl"
    write_scenario(path)
    rows = {row.phase: row for row in _summary([path]).latency}
    assert list(rows) == [
        "queued",
        "encode",
        "embedding_transfer",
        "prefill",
        "kv_transfer",
        "ttft",
        "tpot",
        "e2e",
    ]
    assert rows["e2e"].count == rows["prefill"].count == 6  # six requests finished with `length`
    assert rows["encode"].count == 3  # three of them had an image
    # The scenario's clock: every prefill takes 10 ms, every encode 6 ms; after the first token the KV
    # transfer (0.5 + 1 + 0.2 ms), the migration queue (0.5 ms) and 16 ms for the other 3 tokens.
    assert rows["prefill"].p50 == rows["prefill"].max == pytest.approx(0.010, abs=1e-6)
    assert rows["encode"].mean == pytest.approx(0.006, abs=1e-6)
    assert rows["tpot"].max == pytest.approx((0.0017 + 0.0005 + 0.016) / 3, abs=1e-6)
    for row in rows.values():
        assert row.p50 <= row.p90 <= row.p99 <= row.max


def test_time_per_state_covers_each_replicas_life_and_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "node.jsonl"
    expected = write_scenario(path)
    summary = _summary([path])
    for replica, states in expected.states.items():
        rows = [row for row in summary.states if row.replica == replica]
        assert {row.state for row in rows} == set(states)
        assert sum(row.seconds for row in rows) == pytest.approx(expected.end_ts - START_TS, abs=1e-6)
        assert sum(row.share for row in rows) == pytest.approx(1.0)
    decode_1 = {row.state: row.entered for row in summary.states if row.replica == "decode-1"}
    assert decode_1["Decode"] == 2 and decode_1["ShuttingNull"] == 1
    assert [(lock.replica, lock.periods, lock.reasons) for lock in summary.locks] == [
        ("decode-1", 1, ["manual"])
    ]
    assert summary.locks[0].seconds == pytest.approx(0.02 + 0.003 + 0.0307, abs=5e-3)


def test_a_truncated_log_still_summarises_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "node.jsonl"
    write_scenario(path)
    lines = path.read_bytes().splitlines(keepends=True)
    cut = len(lines) * 2 // 3
    path.write_bytes(b"".join(lines[:cut]) + lines[cut][: len(lines[cut]) // 2])
    summary = _summary([path])
    assert summary.logs[0].truncated_bytes == len(lines[cut]) // 2
    assert summary.warnings[0].startswith(f"{path}: the last line is cut off after")
    assert 0 < summary.requests.arrived < 8
    ended = summary.requests.finished_length + summary.requests.cancelled + summary.requests.failed
    assert ended + summary.requests.queued + summary.requests.running == summary.requests.arrived


def test_two_nodes_logs_merge(tmp_path: Path) -> None:
    first, second = tmp_path / "node-a.jsonl", tmp_path / "node-b.jsonl"
    expected = write_scenario(first, prefix="a")
    write_scenario(second, start_ts=START_TS + 0.05, prefix="b")
    merged = _summary([first, second])
    _check_counts(merged, expected, copies=2)
    assert merged.warnings == [
        "replica name(s) decode-0, decode-1, encode-0, prefill-0, prefill-1 were started by several logs: they "
        "are analysed as one replica; pass --label-logs when the logs come from independent nodes"
    ]
    labelled = _summary([first, second], label_logs=True)
    _check_counts(labelled, expected, copies=2)
    assert labelled.warnings == []
    assert {row.replica for row in labelled.states} == {
        f"{node}/{r}" for node in ("node-a", "node-b") for r in expected.states
    }
    assert labelled.span_s == pytest.approx(expected.end_ts - START_TS + 0.05, abs=1e-6)


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1), st.integers(1, 100))
def test_percentile_is_the_nearest_rank(values: list[float], p: int) -> None:
    ordered = sorted(values)
    result = percentile(ordered, p)
    assert result in ordered
    assert sum(value <= result for value in ordered) >= p / 100 * len(ordered)
    assert sum(value < result for value in ordered) < p / 100 * len(ordered)


def test_percentile_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match=r"^percentile of no values$"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"^percentile 0 is outside \(0, 100\]$"):
        percentile([1.0], 0)
