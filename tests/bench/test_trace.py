"""The `trace` benchmark: its generator is deterministic for a seed, a CSV trace is read through its column
mapping and window, the vendored Azure trace is its default, the oracle's schedule is computed as
documented, the figures are computed as documented, and `python -m engine.bench trace --json --quick`
runs its ways end to end and prints rows of the shape every benchmark prints. No figure is compared with
a speed."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from engine.bench.rows import Row
from engine.bench.trace import add_arguments, trace_speed
from engine.bench.trace.gen import (
    AZURE_CONV,
    Lengths,
    Shape,
    TraceRequest,
    gamma_shape,
    generate,
    parse_columns,
    peak_window,
    read_csv,
    trace_from,
    window,
)
from engine.bench.trace.ideal import ideal_static
from engine.bench.trace.oracle import schedule
from engine.bench.trace.slo import (
    Outcome,
    ReplicaSample,
    Slo,
    Spent,
    attainment,
    quantile,
    replica_seconds,
    spent,
)
from replicas.emulation import parse_emulated_speed
from replicas.loading.pieces import model_bytes
from replicas.model.tiny import TINY_CONFIG

SHAPE = Shape(
    rate=5.0, duration=30.0, gamma_shape=gamma_shape(2.0), burst_factor=6.0, burst_at=10.0, burst_len=5.0
)


def test_the_generator_is_deterministic_for_a_seed() -> None:
    lengths = Lengths(prompt_mean=200.0, prompt_min=8, prompt_max=600, output_mean=10.0, output_max=40)
    first, again, other = (
        generate(SHAPE, lengths, 3),
        generate(SHAPE, lengths, 3),
        generate(SHAPE, lengths, 4),
    )
    assert first == again and first != other
    assert [r.at for r in first] == sorted(r.at for r in first)
    assert all(0.0 <= r.at < SHAPE.duration for r in first)
    assert all(8 <= r.prompt_tokens <= 600 and 1 <= r.output_tokens <= 40 for r in first)
    inside = sum(10.0 <= r.at < 15.0 for r in first) / 5.0
    outside = sum(not 10.0 <= r.at < 15.0 for r in first) / 25.0
    assert inside > 2 * outside  # this seed's burst: the rate × 6 there


def test_the_cumulative_rate_and_its_inverse_agree() -> None:
    for t in (0.0, 4.0, 10.0, 12.5, 15.0, 29.0):
        assert SHAPE.time_of(SHAPE.cumulative(t)) == pytest.approx(t)
    assert SHAPE.cumulative(30.0) == pytest.approx(5.0 * 30.0 + 5.0 * 5.0 * 5.0)
    assert gamma_shape(1.0) == 1.0 and gamma_shape(2.0) == 0.25


def test_a_csv_is_read_through_its_column_mapping(tmp_path: Path) -> None:
    path = tmp_path / "burst.csv"
    path.write_text(
        "Timestamp,Model,Request tokens,Response tokens\n"
        "105.5,ChatGPT,300,40\n"
        "100.0,ChatGPT,20,7\n"
        "101.0,GPT-4,5000,0\n"
        "130.0,GPT-4,64,8\n"
    )
    columns = parse_columns("arrival=Timestamp, prompt=Request tokens ,output=Response tokens")
    assert columns == {"arrival": "Timestamp", "prompt": "Request tokens", "output": "Response tokens"}
    lengths = Lengths(prompt_min=16, prompt_max=2048, output_max=32)
    trace = read_csv(path, columns, lengths, time_scale=0.5, duration=10.0)
    assert trace == [
        TraceRequest(0.0, 20, 7),
        TraceRequest(0.5, 2048, 1),  # clipped: the prompt to --prompt-max, a failed request's 0 to 1
        TraceRequest(2.75, 300, 32),
    ]  # 130.0 lies at 15 s: past the duration
    assert read_csv(path, columns, lengths, offset=1.0, duration=10.0)[0] == TraceRequest(0.0, 2048, 1)
    # the window is in the trace's own seconds; then time and lengths are scaled
    scaled = read_csv(path, columns, lengths, offset=5.0, duration=30.0, time_scale=0.5, length_scale=0.5)
    assert scaled == [TraceRequest(0.25, 150, 20), TraceRequest(12.5, 32, 4)]


def test_a_csv_with_date_times_and_bad_mappings(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:48.1805900,396,109\n"
    )
    columns = parse_columns("arrival=TIMESTAMP,prompt=ContextTokens,output=GeneratedTokens")
    trace = read_csv(path, columns, Lengths(output_max=128))
    assert [(r.prompt_tokens, r.output_tokens) for r in trace] == [(374, 44), (396, 109)]
    assert [r.at for r in trace] == pytest.approx([0.0, 1.5])
    with pytest.raises(ValueError, match="no column 'Missing'"):
        read_csv(path, {**columns, "prompt": "Missing"}, Lengths())
    with pytest.raises(ValueError, match="no column for output"):
        parse_columns("arrival=TIMESTAMP,prompt=ContextTokens")
    with pytest.raises(ValueError, match="ROLE=COLUMN"):
        parse_columns("arrival=TIMESTAMP,tokens=ContextTokens,output=GeneratedTokens")
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,1\n")
    with pytest.raises(ValueError, match=r"azure\.csv:2"):
        read_csv(path, columns, Lengths())


def test_the_default_trace_is_the_vendored_azure_conversation_trace() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    trace = trace_from(args)
    assert (args.trace, args.trace_offset, args.duration, args.time_scale, args.length_scale) == (
        "azure-conv",
        1920.0,
        240.0,
        0.5,
        0.25,
    )
    assert AZURE_CONV.read_text(encoding="utf-8-sig").startswith("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    assert (AZURE_CONV.parent / "README.md").read_text().count("CC BY 4.0") >= 1  # its attribution beside it
    assert 1000 < len(trace) < 3000 and all(0.0 <= r.at < 120.0 for r in trace)  # 240 s replayed in 120
    other = trace_from(parser.parse_args(["--trace-offset", "2400", "--duration", "60", "--time-scale", "1"]))
    assert other != trace[: len(other)] and all(0.0 <= r.at < 60.0 for r in other)
    synthetic = parser.parse_args(["--trace", "synthetic"])
    assert trace_from(synthetic) and synthetic.duration == 60.0


def test_the_oracle_schedules_replicas_ahead_of_the_load() -> None:
    """2 s windows, 1000 tokens/s per replica at 0.5: 1000 tokens/s need 2 replicas, 3000 need 6. The
    clump at 10.5 s lies in the windows from 8.75 s (on the 0.25 s grid) to 10.5 s; with a 1 s lead the
    command for 6 comes at 7.75 s, and the count falls back to 2 at 10.75 s."""
    trace = [TraceRequest(float(t), 2000, 1) for t in range(0, 20, 2)]  # 1000 tokens/s
    trace.append(TraceRequest(10.5, 4000, 1))
    trace.sort(key=lambda r: r.at)
    plan = schedule(trace, capacity=1000.0, upper=0.5, window=2.0, lead=1.0, minimum=1, maximum=8)
    assert plan[:3] == [(0.0, 2), (7.75, 6), (10.75, 2)]
    assert plan[-1][1] == 1  # past the last arrival's window: the minimum
    assert schedule(trace, capacity=1000.0, upper=0.5, window=2.0, lead=1.0, minimum=1, maximum=4)[1] == (
        7.75,
        4,
    )  # capped


def test_the_peak_window_holds_the_most_prompt_tokens() -> None:
    trace = [TraceRequest(t, n, 1) for t, n in ((0.0, 100), (1.0, 50), (3.0, 400), (3.5, 400), (9.0, 10))]
    assert peak_window(trace, 2.0) == (3.0, 5.0)
    assert window(trace, 3.0, 5.0) == [TraceRequest(0.0, 400, 1), TraceRequest(0.5, 400, 1)]


def test_slo_attainment_quantiles_and_replica_seconds() -> None:
    slo = Slo(floor=0.3, per_token=0.001)
    outcomes = [
        Outcome(0.0, 100, 4, 0.29, 0.02, 1.0),  # limit 0.3: met
        Outcome(0.0, 1000, 4, 0.9, 0.02, 1.0),  # limit 1.0: met
        Outcome(0.0, 1000, 4, 1.1, 0.02, 1.0),  # missed
        Outcome(0.0, 10, 4, None, None, 1.0, "overloaded"),  # failed: missed
    ]
    assert attainment(outcomes, slo) == 0.5
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0 and quantile([3.0, 1.0, 2.0], 0.99) == 3.0
    assert math.isnan(quantile([], 0.5))
    samples = [ReplicaSample(-0.5, 2, 1, 1), ReplicaSample(1.0, 4, 3, 1), ReplicaSample(3.0, 3, 2, 1)]
    assert replica_seconds(samples, 0.0, 4.0) == pytest.approx(2 * 1.0 + 4 * 2.0 + 3 * 1.0)
    loading = [ReplicaSample(0.0, 3, 2, 1, loading=1), ReplicaSample(1.0, 3, 2, 1, draining=1)]
    assert spent(loading, 0.0, 2.0) == Spent(prefill=4.0, decode=2.0, loading=1.0, draining=1.0)


@pytest.mark.slow
def test_each_weight_source_copies_at_its_emulated_speed() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    speed = parse_emulated_speed(
        trace_speed(parser.parse_args(["--load-seconds", "2", "--peer-speedup", "4"]))
    )
    host = model_bytes(TINY_CONFIG) / 2.0 / 1e9
    assert speed.copy_gb_per_s("host") == pytest.approx(host, rel=1e-5)
    assert speed.copy_gb_per_s("peer") == pytest.approx(4 * host, rel=1e-5)
    assert speed.copy_gb_per_s("disk") == pytest.approx(host / 8, rel=1e-5)
    with pytest.raises(SystemExit, match="--peer-speedup and --disk-slowdown must be > 0"):
        trace_speed(parser.parse_args(["--disk-slowdown", "0"]))


@pytest.mark.timeout(600)  # a minute alone (a node per way, one after another), minutes on a loaded machine
def test_quick_run_prints_the_rows(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    picture = tmp_path / "trace.svg"
    command = [sys.executable, "-m", "engine.bench", "trace", "--json", "--quick"]
    command += ["--logs", str(tmp_path / "logs"), "--plot", str(picture)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert {field for r in rows for field in r} == set(Row.__struct_fields__)
    assert all(r["bench"] == "trace" for r in rows)
    metrics = {"slo_attainment", "ttft_p50_s", "ttft_p99_s", "replica_seconds", "scale_events"}
    metrics |= {"late_loading_replica_s"}
    by_case: dict[str, set[str]] = {}
    for r in rows:
        by_case.setdefault(r["case"], set()).add(r["metric"])
    assert by_case == {
        "static": {"prefill_replicas", "replica_seconds", "slo_attainment", "ttft_p50_s", "ttft_p99_s"},
        "kalman": metrics,
        "serverless": metrics,
        "oracle": metrics,
        "blitz-vs-serverless": {"ttft_p99_s"},
        "bound": {"slo_attainment_model", "replica_seconds"},
    }
    static = next(r for r in rows if r["case"] == "static" and r["metric"] == "prefill_replicas")
    assert (
        static["project"] in (1.0, 2.0) and static["baseline"] is None and "attainment per" in static["note"]
    )
    for r in rows:
        if r["case"] in ("kalman", "serverless", "oracle") and r["metric"] not in (
            "scale_events",
            "late_loading_replica_s",
        ):
            assert r["baseline_name"] == f"static prefill={int(static['project'])}"
            assert math.isfinite(r["project"]) and math.isfinite(r["baseline"])
    # The feasible bound: never above static's count over the span (the measured replica-seconds integrate
    # polled samples, so they may fall short of it by a poll), its schedule and its check in the notes.
    bound = {r["metric"]: r for r in rows if r["case"] == "bound"}
    assert 0 < bound["replica_seconds"]["project"] <= 1.05 * bound["replica_seconds"]["baseline"]
    assert "prefill counts per 1 s" in bound["replica_seconds"]["note"]
    late = [r for r in rows if r["metric"] == "late_loading_replica_s"]
    assert late and all(r["project"] >= 0 and "after the need passed" in r["note"] for r in late)
    assert (
        0 <= bound["slo_attainment_model"]["project"] <= 1
        and "points" in bound["slo_attainment_model"]["note"]
    )
    seconds = {
        r["case"]: r
        for r in rows
        if r["metric"] == "replica_seconds" and r["case"] not in ("static", "bound")
    }
    assert all(r["project"] > 0 and "goal <= 0.55" in r["note"] for r in seconds.values())
    (versus,) = (r for r in rows if r["case"] == "blitz-vs-serverless")
    assert versus["baseline_name"] == "serverless" and "goal <= 0.5" in versus["note"]
    assert picture.read_text().lstrip().startswith("<?xml")
    logs = tmp_path / "logs"
    assert {"static.jsonl", "kalman.jsonl", "serverless.jsonl", "oracle.jsonl", "static-probe-1.jsonl"} <= {
        p.name for p in logs.glob("*.jsonl")
    }
    # every decision of the kalman way names its forecast; the oracle's node has no planner
    decided = [
        json.loads(x) for x in (logs / "kalman.jsonl").read_text().splitlines() if "planner_decision" in x
    ]
    assert decided and all(
        d["forecast"]["predictor"] == "kalman" for d in decided if d["action"] != "release"
    )
    assert "planner_decision" not in (logs / "oracle.jsonl").read_text()


def test_the_ideal_static_model_by_hand() -> None:
    """Two ideal replicas at 1,000 tokens/s: three 1,000-token prompts at 0 s end at 1, 1 and 2 s (the
    third waits for the first free replica); a fourth at 5 s finds both idle. SLO floor 1.5 s."""
    trace = [TraceRequest(0.0, 1000, 1), TraceRequest(0.0, 1000, 1), TraceRequest(0.0, 1000, 1)]
    trace.append(TraceRequest(5.0, 500, 1))
    attainment, p50, p99 = ideal_static(trace, 2, 1000.0, Slo(floor=1.5, per_token=0.0))
    assert attainment == 0.75
    assert (p50, p99) == (1.0, 2.0)
    with pytest.raises(ValueError):
        ideal_static(trace, 0, 1000.0, Slo())
