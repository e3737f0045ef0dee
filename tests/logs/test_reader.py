"""engine.logs.reader: typed events from real log files, damaged lines, truncation, merging, labels."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.logging import open_event_log
from engine.logs.reader import LogError, LogSet, read_entries, relabel
from messages.log.events import (
    BlocksReport,
    ClientConnected,
    Flow,
    FlowReport,
    NodeStarted,
    PrefillStarted,
    ReplicaBlocks,
    ReplicaStateChanged,
    TransferRound,
)
from tests.logs.scenario import write_scenario


def _node_started(ts: float, replicas: list[str]) -> NodeStarted:
    return NodeStarted(
        ts=ts,
        listen="127.0.0.1:0",
        model="tiny",
        device="cpu",
        transport="inproc",
        replicas=replicas,
        pid=1,
        version="0",
    )


def _write(path: Path, events: list[object]) -> None:
    log = open_event_log(file=str(path), console=None)
    for event in events:
        log.emit(event)  # type: ignore[arg-type]
    log.close()


def test_every_emitted_event_comes_back_typed_in_file_order(tmp_path: Path) -> None:
    path = tmp_path / "node.jsonl"
    expected = write_scenario(path)
    entries, logs = read_entries([path])
    assert logs.warnings() == []
    assert [entry.line for entry in entries] == list(range(1, len(entries) + 1))
    assert entries[0].event.ts == pytest.approx(1_790_000_000.0)
    assert entries[-1].event.ts == pytest.approx(expected.end_ts)
    assert logs.stats[0].events == len(entries) == len(path.read_bytes().splitlines())


def test_lines_that_are_not_events_are_counted_and_skipped(tmp_path: Path) -> None:
    path = tmp_path / "node.jsonl"
    _write(path, [ClientConnected(ts=1.0, connection="c1", peer="p")])
    with path.open("ab") as handle:
        handle.write(b"hello\n")
        handle.write(b'{"event":"no_such_event","ts":2.0}\n')
        handle.write(b"\n")
        handle.write(b'{"event":"client_connected","ts":3.0,"connection":"c2"}\n')
        handle.write(b"[1, 2]\n")
    _write(path, [ClientConnected(ts=4.0, connection="c3", peer="p")])
    entries, logs = read_entries([path])
    assert [entry.event for entry in entries] == [
        ClientConnected(ts=1.0, connection="c1", peer="p"),
        ClientConnected(ts=4.0, connection="c3", peer="p"),
    ]
    assert [entry.line for entry in entries] == [1, 7]
    stats = logs.stats[0]
    assert stats.skipped_lines == 4 and stats.truncated_bytes == 0
    assert logs.warnings() == [
        f"{path}: skipped 4 line(s) that are not events (e.g. line 2: JSON is malformed: invalid character "
        "(byte 0); line 3: Invalid value 'no_such_event' - at `$.event`; line 5: Object missing required "
        "field `peer`)"
    ]


def test_a_log_cut_off_mid_line_is_read_up_to_the_damage(tmp_path: Path) -> None:
    path = tmp_path / "node.jsonl"
    write_scenario(path)
    data = path.read_bytes()
    lines = data.splitlines(keepends=True)
    kept = b"".join(lines[:40]) + lines[40][:25]
    path.write_bytes(kept)
    entries, logs = read_entries([path])
    assert len(entries) == 40
    assert logs.stats[0].truncated_bytes == 25 and logs.stats[0].skipped_lines == 0
    assert logs.warnings() == [
        f"{path}: the last line is cut off after 25 bytes (the writer stopped mid-line, e.g. a crash); "
        "read the 40 events before it"
    ]


def test_a_complete_last_line_without_its_newline_is_an_event(tmp_path: Path) -> None:
    path = tmp_path / "node.jsonl"
    _write(path, [ClientConnected(ts=1.0, connection="c1", peer="p")])
    path.write_bytes(path.read_bytes().rstrip(b"\n"))
    entries, logs = read_entries([path])
    assert len(entries) == 1 and logs.warnings() == []


def test_several_logs_merge_by_time_keeping_each_files_order(tmp_path: Path) -> None:
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _write(first, [ClientConnected(ts=ts, connection=f"a{ts:g}", peer="p") for ts in (1.0, 3.0, 5.0, 5.0)])
    _write(second, [ClientConnected(ts=ts, connection=f"b{ts:g}", peer="p") for ts in (2.0, 3.0, 6.0)])
    entries, _ = read_entries([first, second])
    assert [(entry.event.connection, entry.log) for entry in entries] == [  # type: ignore[union-attr]
        ("a1", 0),
        ("b2", 1),
        ("a3", 0),
        ("b3", 1),
        ("a5", 0),
        ("a5", 0),
        ("b6", 1),
    ]


def test_label_logs_prefixes_every_name_with_the_files_label(tmp_path: Path) -> None:
    event = BlocksReport(
        ts=1.0,
        replicas=[
            ReplicaBlocks(
                replica="decode-0",
                state="Decode",
                used_blocks=1,
                cached_blocks=0,
                total_blocks=8,
                locked=False,
            )
        ],
    )
    assert relabel(event, "a").replicas[0].replica == "a/decode-0"  # type: ignore[union-attr]
    flows = relabel(
        FlowReport(
            ts=1.0,
            interval_s=1.0,
            flows=[Flow(source="prefill-0", destination="decode-0", kind="kv", bytes=5)],
        ),
        "n",
    )
    assert flows == FlowReport(
        ts=1.0,
        interval_s=1.0,
        flows=[Flow(source="n/prefill-0", destination="n/decode-0", kind="kv", bytes=5)],
    )
    assert relabel(_node_started(1.0, ["decode-0"]), "n").replicas == ["n/decode-0"]  # type: ignore[union-attr]
    transfer = relabel(
        TransferRound(
            ts=1.0,
            request_id="r1",
            replica="prefill-0",
            kind="kv",
            transfer_id="t1",
            round=0,
            offset=0,
            tokens=1,
            total_tokens=1,
            bytes=8,
            source="prefill-0",
            destination="decode-0",
            transport="inproc",
        ),
        "n",
    )
    assert (
        transfer.request_id,
        transfer.replica,
        transfer.transfer_id,
        transfer.source,
        transfer.destination,
    ) == (  # type: ignore[union-attr]
        "n/r1",
        "n/prefill-0",
        "n/t1",
        "n/prefill-0",
        "n/decode-0",
    )
    state = relabel(
        ReplicaStateChanged(
            ts=1.0,
            replica="decode-0",
            from_state="Decode",
            to_state="ShuttingDecode",
            trigger="command",
            reason="op",
        ),
        "n",
    )
    assert state.replica == "n/decode-0" and state.to_state == "ShuttingDecode"  # type: ignore[union-attr]


def test_files_sharing_a_stem_get_distinct_labels(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    paths = [tmp_path / "node.jsonl", tmp_path / "x" / "node.jsonl"]
    for path in paths:
        _write(path, [PrefillStarted(ts=1.0, request_id="r1", replica="prefill-0", tokens=3, batch_size=1)])
    entries, _ = read_entries(paths, label_logs=True)
    assert sorted(entry.event.request_id for entry in entries) == ["node#0/r1", "node#1/r1"]  # type: ignore[union-attr]


def test_replicas_started_by_several_logs_are_flagged(tmp_path: Path) -> None:
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _write(first, [_node_started(1.0, ["prefill-0", "decode-0"])])
    _write(second, [_node_started(2.0, ["decode-0", "decode-1"])])
    _, logs = read_entries([first, second])
    assert logs.warnings() == [
        "replica name(s) decode-0 were started by several logs: they are analysed as one replica; pass "
        "--label-logs when the logs come from independent nodes"
    ]
    _, labelled = read_entries([first, second], label_logs=True)
    assert labelled.warnings() == []


def test_a_missing_log_is_an_error_naming_it(tmp_path: Path) -> None:
    present = tmp_path / "a.jsonl"
    _write(present, [ClientConnected(ts=1.0, connection="c1", peer="p")])
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(LogError, match=r"^cannot read log '.*nope\.jsonl': No such file or directory$"):
        LogSet([present, missing])
    with pytest.raises(LogError, match=r"^no log files given$"):
        LogSet([])


def test_a_field_this_reader_does_not_know_is_ignored(tmp_path: Path) -> None:
    """A newer node may add fields (docs/logging.md, Evolution): this reader still reads its lines."""
    path = tmp_path / "node.jsonl"
    path.write_bytes(
        b'{"event":"client_connected","ts":1.0,"connection":"c1","peer":"p","tls":"none"}\n'
        b'{"event":"blocks_report","ts":2.0,"replicas":[{"replica":"decode-0","state":"Decode",'
        b'"used_blocks":1,"cached_blocks":0,"total_blocks":8,"locked":false,"pinned_blocks":0}]}\n'
    )
    entries, logs = read_entries([path])
    assert entries[0].event == ClientConnected(ts=1.0, connection="c1", peer="p")
    assert len(entries) == 2 and logs.warnings() == []
