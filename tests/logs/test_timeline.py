"""The timeline: a lane per replica with the states emitted, lock periods, request spans, the picture."""

from __future__ import annotations

import itertools
import struct
import sys
from pathlib import Path

import msgspec
import pytest

from engine.logs.__main__ import main
from engine.logs.aggregate import Aggregator
from engine.logs.reader import read_entries
from engine.logs.timeline import Timeline, build_timeline
from tests.logs.scenario import START_TS, write_scenario

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _timeline(path: Path, **options: int) -> Timeline:
    entries, _ = read_entries([path])
    aggregator = Aggregator()
    for entry in entries:
        aggregator.add(entry.event)
    return build_timeline(aggregator, **options)


def test_a_lane_per_replica_with_the_states_it_went_through(tmp_path: Path) -> None:
    path = tmp_path / "node.jsonl"
    expected = write_scenario(path)
    timeline = _timeline(path)
    assert timeline.start_ts == pytest.approx(START_TS)
    lanes = {lane.replica: lane for lane in timeline.lanes}
    assert set(lanes) == set(expected.states)
    for replica, states in expected.states.items():
        segments = lanes[replica].segments
        assert [segment.state for segment in segments] == states
        assert segments[0].start == 0.0  # from node_started: the state it started in
        assert all(a.end == b.start for a, b in itertools.pairwise(segments))
        assert segments[-1].open and segments[-1].end == pytest.approx(timeline.end)
    locks = lanes["decode-1"].locks
    assert [(lock.reasons, lock.open) for lock in locks] == [(["manual"], False)]
    assert 0 < locks[0].start < locks[0].end < timeline.end
    assert all(not lane.locks for name, lane in lanes.items() if name != "decode-1")


def test_request_spans_hold_their_phases(tmp_path: Path) -> None:
    path = tmp_path / "node.jsonl"
    expected = write_scenario(path)
    spans = {span.request_id: span for span in _timeline(path).requests}
    assert list(spans) == expected.request_ids
    assert [phase.name for phase in spans["r2"].phases] == [
        "queued",
        "encode",
        "embedding_transfer",
        "prefill",
        "kv_transfer",
        "decode",
    ]
    assert [phase.name for phase in spans["r6"].phases] == ["queued", "prefill", "kv_transfer"]
    assert {span.request_id: span.outcome for span in spans.values() if span.outcome != "length"} == {
        "r5": "cancelled",
        "r6": "failed",
    }
    prefill = next(phase for phase in spans["r4"].phases if phase.name == "prefill")
    assert prefill.replica == "prefill-1" and prefill.end - prefill.start == pytest.approx(0.010, abs=1e-6)
    for span in spans.values():
        assert all(span.start <= phase.start <= phase.end <= span.end + 1e-9 for phase in span.phases)
    # The scenario's requests run one after another: one row is enough.
    assert {span.row for span in spans.values()} == {0}


def test_overlapping_requests_get_their_own_rows_up_to_the_limit(tmp_path: Path) -> None:
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_scenario(first, prefix="a")
    write_scenario(second, prefix="b", start_ts=START_TS + 0.001)
    entries, _ = read_entries([first, second], label_logs=True)
    aggregator = Aggregator()
    for entry in entries:
        aggregator.add(entry.event)
    timeline = build_timeline(aggregator)
    assert timeline.rows == 2
    assert {span.row for span in timeline.requests} == {0, 1}
    assert len(timeline.lanes) == 10
    capped = build_timeline(aggregator, max_rows=1)
    assert capped.rows == 1 and {span.row for span in capped.requests} == {0}


def test_timeline_command_writes_a_png_and_prints_the_same_data_as_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "node.jsonl"
    write_scenario(path)
    picture = tmp_path / "timeline.png"
    assert main(["timeline", str(path), "-o", str(picture), "--json"]) == 0
    data = picture.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert width > 500 and height > 200
    printed = msgspec.json.decode(capsys.readouterr().out, type=Timeline)
    assert printed == _timeline(path)


def test_timeline_command_says_how_to_install_matplotlib_when_it_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "node.jsonl"
    write_scenario(path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an environment without it looks like
    monkeypatch.delitem(sys.modules, "engine.logs.plot", raising=False)
    monkeypatch.delitem(sys.modules, "matplotlib.figure", raising=False)
    assert main(["timeline", str(path), "-o", str(tmp_path / "t.png")]) == 3
    assert capsys.readouterr().err == (
        "python -m engine.logs: the timeline picture needs matplotlib, which is not installed: "
        "pip install 'zigzag[plot]' (or use --json for the data)\n"
    )
    assert not (tmp_path / "t.png").exists()
    assert main(["timeline", str(path), "--json"]) == 0  # the data needs no matplotlib


def test_timeline_command_needs_an_output_or_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "node.jsonl"
    write_scenario(path)
    assert main(["timeline", str(path)]) == 2
    assert capsys.readouterr().err == (
        "python -m engine.logs: timeline: give -o FILE.png for the picture, or --json for the data\n"
    )


@pytest.mark.parametrize("output", ["timeline.json", "timeline", ""])
def test_timeline_command_refuses_an_output_that_is_not_a_picture_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], output: str
) -> None:
    """matplotlib picks the format by the suffix: `.json` raised its traceback, no suffix or an empty name
    wrote `<name>.png` while the command said it wrote `<name>`."""
    path = tmp_path / "node.jsonl"
    write_scenario(path)
    target = str(tmp_path / output) if output else ""
    assert main(["timeline", str(path), "-o", target]) == 2
    assert capsys.readouterr().err == (
        f"python -m engine.logs: timeline: -o {target!r} must name a picture file ending in .png, .svg, .pdf\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node.jsonl"]


def test_the_replica_and_in_flight_axes_have_whole_number_ticks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replicas and requests come whole: the count panel's ticks are integers, however few there are."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from engine.logs.plot import draw_timeline

    path = tmp_path / "node.jsonl"
    write_scenario(path)
    drawn: list[Figure] = []
    save = Figure.savefig

    def keep(figure: Figure, *args: object, **kwargs: object) -> None:
        drawn.append(figure)
        save(figure, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Figure, "savefig", keep)
    draw_timeline(_timeline(path), tmp_path / "t.png")
    (figure,) = drawn
    counts = next(axes for axes in figure.axes if axes.get_ylabel() == "replicas")
    load = next(axes for axes in figure.axes if axes.get_ylabel() == "requests in flight")
    for axes in (counts, load):
        ticks = [tick for tick in axes.get_yticks() if axes.get_ylim()[0] <= tick <= axes.get_ylim()[1]]
        assert len(ticks) >= 2 and all(float(tick).is_integer() for tick in ticks), ticks
