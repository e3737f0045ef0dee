"""trace: the planner against static provisioning, on one bursty trace with emulated accelerators.

The trace (engine/bench/trace/gen.py): seeded Gamma arrivals with a burst, or a CSV trace (`--trace-csv`,
`--columns`, `--time-scale`). It is replayed (engine/bench/trace/replay.py) on one node process per way,
tiny model, `--max-batch-tokens` (512), every replica emulating an accelerator (`--emulated-speed`:
`--prefill-tokens-per-s` 5000, `--decode-steps-per-s` 50, a weight copy from host memory of `--load-seconds`
2, from a peer replica `--peer-speedup` (8) times faster, from disk `--disk-slowdown` (8) times slower — the
ratios of NVLink, PCIe host-to-device and NVMe on an H100 SXM host, about 450, 55 and 7 GB/s):

- **static**: `--replicas prefill=N,decode=1`, no planner. N is the smallest count, from 1 up to
  `--max-prefill-replicas` (4), whose SLO attainment on the trace's peak (the `--peak-window`-second
  window with the most prompt tokens, replayed alone) reaches `--slo-target` (0.9); `--static-replicas N`
  skips that search.
- **serverless**: `--replicas prefill=1,decode=1 --autoscale --autoscale-policy serverless` (stop-the-world,
  weights from the host copy), the planner told one replica's speed (`--prefill-tokens-per-s`) and capped
  at `--max-prefill-replicas`.
- **blitz**: the same with `--autoscale-policy blitz` (prefill scales up with ZigZag).

Figures (engine/bench/trace/slo.py): SLO attainment (TTFT ≤ max(`--slo-ttft-floor`, `--slo-ttft-per-token`
× prompt tokens)), TTFT and TPOT p50/p99, and replica-seconds (replicas not `Inactive`, polled from
`status` every 0.1 s, integrated from the trace's start to the last request's end). Rows: each autoscale
way against static, and blitz's p99 TTFT against serverless's. Goals: blitz p99 TTFT ≤ 0.5 × serverless;
replica-seconds ≤ 0.7 × static with attainment within 5 points of static's.

`--plot FILE` draws TTFT and the replica count over time, three ways (engine/bench/trace/plot.py);
`--logs DIR` keeps the nodes' logs.
"""

from __future__ import annotations

import argparse
import math
import shlex
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Final

from engine.bench.rows import Row, row
from engine.bench.trace.gen import TraceRequest, peak_window, prompt_tokens_per_s, trace_from, window
from engine.bench.trace.gen import add_arguments as add_trace_arguments
from engine.bench.trace.replay import Run, replay_on_node
from engine.bench.trace.slo import Slo, Summary, attainment, summarize

BENCH: Final = "trace"
BASELINE: Final = "static"
WAYS: Final = ("static", "serverless", "blitz")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trace_arguments(parser)
    group = parser.add_argument_group("the nodes and the SLO")
    group.add_argument("--ways", default=",".join(WAYS), help="comma-separated: static, serverless, blitz")
    group.add_argument("--prefill-tokens-per-s", type=float, default=5000.0, help="emulated (default 5000)")
    group.add_argument("--decode-steps-per-s", type=float, default=50.0, help="emulated (default 50)")
    group.add_argument(
        "--load-seconds", type=float, default=2.0, help="emulated weight copy from host memory (default 2)"
    )
    group.add_argument(
        "--peer-speedup", type=float, default=8.0, help="a copy from a peer is this much faster (default 8)"
    )
    group.add_argument(
        "--disk-slowdown", type=float, default=8.0, help="a copy from disk is this much slower (default 8)"
    )
    group.add_argument("--max-batch-tokens", type=int, default=512, help="prompt tokens per batch (512)")
    group.add_argument(
        "--max-prefill-replicas", type=int, default=4, help="static search's and planner's cap"
    )
    group.add_argument("--keep-alive", type=float, default=None, help="the planner's --autoscale-keep-alive")
    group.add_argument(
        "--planner-options",
        default="",
        help='more node options for the autoscale ways, e.g. "--autoscale-down-after 1 --autoscale-drain 0.5"',
    )
    group.add_argument("--static-replicas", type=int, default=None, help="static's prefill count (no search)")
    group.add_argument("--peak-window", type=float, default=10.0, help="seconds of the static search's peak")
    group.add_argument("--slo-target", type=float, default=0.9, help="attainment static must reach (0.9)")
    group.add_argument("--slo-ttft-floor", type=float, default=0.3, help="TTFT SLO floor, s (default 0.3)")
    group.add_argument("--slo-ttft-per-token", type=float, default=0.000375, help="TTFT SLO per prompt token")
    group.add_argument(
        "--no-planner-slo",
        dest="planner_slo",
        action="store_false",
        help="do not tell the planner the SLO (--autoscale-slo-ttft): it scales by its utilisation band alone",
    )
    group.add_argument(
        "--plot", type=Path, default=None, help="draw TTFT and replicas over time into this file"
    )
    group.add_argument("--logs", type=Path, default=None, help="keep the nodes' JSON logs in this folder")
    group.add_argument("--quick", action="store_true", help="a 4 s trace, a 1.5 s burst, at most 2 replicas")


def run(args: argparse.Namespace) -> Iterable[Row]:
    if args.quick:
        args.duration, args.burst_at, args.burst_len, args.peak_window = 4.0, 1.0, 1.5, 1.5
        args.rate, args.max_prefill_replicas, args.load_seconds = 3.0, 2, 0.5
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    unknown = set(ways) - set(WAYS)
    if unknown or not ways:
        raise SystemExit(f"--ways: unknown ways {sorted(unknown)} (ways: {', '.join(WAYS)})")
    try:
        trace = trace_from(args)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"trace: {exc}") from None
    if not trace:
        raise SystemExit("trace: no request in the trace")
    directory = Path(tempfile.mkdtemp(prefix="trace-bench-")) if args.logs is None else args.logs
    directory.mkdir(parents=True, exist_ok=True)
    try:
        yield from _rows(args, [w for w in WAYS if w in ways], trace, directory)
    finally:
        if args.logs is None:
            shutil.rmtree(directory, ignore_errors=True)


def node_options(args: argparse.Namespace, speed: str, *, prefill: int, policy: str | None) -> list[str]:
    options = ["--replicas", f"prefill={prefill},decode=1", "--max-batch-tokens", str(args.max_batch_tokens)]
    options += ["--emulated-speed", speed]
    if policy is not None:
        options += ["--autoscale", "--autoscale-policy", policy]
        options += ["--prefill-tokens-per-s", f"{args.prefill_tokens_per_s:g}"]
        options += ["--max-prefill-replicas", str(args.max_prefill_replicas)]
        # The planner is told the SLO the trace is judged by (`--no-planner-slo`: the utilisation band only).
        if args.planner_slo:
            options += ["--autoscale-slo-ttft", f"{args.slo_ttft_floor:g}"]
            options += ["--autoscale-slo-ttft-per-token", f"{args.slo_ttft_per_token:g}"]
        if args.keep_alive is not None:
            options += ["--autoscale-keep-alive", f"{args.keep_alive:g}"]
        options += shlex.split(args.planner_options)
    return options


def trace_speed(args: argparse.Namespace) -> str:
    """`--emulated-speed` of every way: `emulated_speed`'s, host at `--load-seconds`, peer and disk scaled."""
    from engine.bench.zigzag import emulated_speed
    from replicas.emulation import parse_emulated_speed

    if not (args.peer_speedup > 0 and args.disk_slowdown > 0):
        raise SystemExit("trace: --peer-speedup and --disk-slowdown must be > 0")
    speed = emulated_speed(args)
    host = parse_emulated_speed(speed).weights_gb_per_s
    assert host is not None
    return (
        f"{speed},peer_gb_per_s={host * args.peer_speedup:.6g},disk_gb_per_s={host / args.disk_slowdown:.6g}"
    )


def _say(text: str) -> None:
    sys.stderr.write(f"trace: {text}\n")
    sys.stderr.flush()


def find_static(
    args: argparse.Namespace, trace: Sequence[TraceRequest], speed: str, directory: Path, slo: Slo
) -> tuple[int, str]:
    """The smallest prefill count meeting `--slo-target` on the trace's peak, and a note of the probes."""
    start, end = peak_window(trace, args.peak_window)
    peak = window(trace, start, end)
    rate = prompt_tokens_per_s(peak, args.peak_window)
    probes: list[str] = []
    for count in range(1, args.max_prefill_replicas + 1):
        options = node_options(args, speed, prefill=count, policy=None)
        found = replay_on_node(peak, options, directory / f"static-probe-{count}.jsonl", args.seed)
        share = attainment(found.outcomes, slo)
        probes.append(f"{count}: {share:.1%}")
        _say(f"static probe: prefill={count} on the peak [{start:.1f}, {end:.1f}) s: attainment {share:.1%}")
        if share >= args.slo_target:
            break
    else:
        count = args.max_prefill_replicas
        probes.append("none reached the target: the cap")
    note = (
        f"peak [{start:.1f}, {end:.1f}) s of the trace, {len(peak)} requests, {rate:.0f} prompt tokens/s; "
        f"attainment per prefill count ({', '.join(probes)}); target {args.slo_target:.0%}"
    )
    return count, note


def _rows(
    args: argparse.Namespace, ways: list[str], trace: Sequence[TraceRequest], directory: Path
) -> Iterator[Row]:
    speed = trace_speed(args)
    slo = Slo(args.slo_ttft_floor, args.slo_ttft_per_token)
    runs: dict[str, Run] = {}
    summaries: dict[str, Summary] = {}
    static = args.static_replicas
    for way in ways:
        if way == BASELINE:
            if static is None:
                static, note = find_static(args, trace, speed, directory, slo)
            else:
                note = "given by --static-replicas"
            _say(f"static: {static} prefill replica(s)")
            yield row(BENCH, BASELINE, "prefill_replicas", "lower", float(static), note=note)
            options = node_options(args, speed, prefill=static, policy=None)
        else:
            options = node_options(args, speed, prefill=1, policy=way)
        runs[way] = replay_on_node(trace, options, directory / f"{way}.jsonl", args.seed)
        summaries[way] = summary = summarize(runs[way].outcomes, runs[way].samples, slo)
        _say(
            f"{way}: attainment {summary.attainment:.1%}, TTFT p50/p99 {summary.ttft_p50:.3f}/"
            f"{summary.ttft_p99:.3f} s, {summary.replica_seconds:.1f} replica-s over {summary.span:.1f} s, "
            f"{summary.failed} failed"
        )
    yield from _way_rows(args, trace, speed, summaries, static)
    if args.plot is not None and runs:
        from engine.bench.trace.plot import draw

        burst = None if args.trace_csv is not None else (args.burst_at, args.burst_at + args.burst_len)
        labels = {w: (f"static (prefill={static})" if w == BASELINE else f"autoscale {w}") for w in runs}
        draw(
            {labels[w]: r for w, r in runs.items()},
            args.plot,
            slo,
            burst=burst,
            subtitle=f"emulated: {speed}",
        )


def _goal(met: bool) -> str:
    return "met" if met else "missed"


def _describe(args: argparse.Namespace, trace: Sequence[TraceRequest], speed: str) -> str:
    if args.trace_csv is not None:
        what = f"CSV {args.trace_csv.name} x{args.time_scale:g}"
    else:
        what = (
            f"Gamma cv {args.cv:g} at {args.rate:g} req/s, x{args.burst_factor:g} in "
            f"[{args.burst_at:g}, {args.burst_at + args.burst_len:g}) s"
        )
    return (
        f"{len(trace)} requests over {args.duration:g} s ({what}); emulated ({speed}); SLO TTFT <= "
        f"max({args.slo_ttft_floor:g} s, {args.slo_ttft_per_token:g} s x prompt tokens)"
    )


METRICS: Final = (
    ("ttft_p50_s", "ttft_p50"),
    ("ttft_p99_s", "ttft_p99"),
    ("tpot_p50_s", "tpot_p50"),
    ("tpot_p99_s", "tpot_p99"),
)


def _way_rows(
    args: argparse.Namespace,
    trace: Sequence[TraceRequest],
    speed: str,
    summaries: dict[str, Summary],
    static: int | None,
) -> Iterator[Row]:
    """Each autoscale way against static (when it ran), then blitz's p99 TTFT against serverless's."""
    common = _describe(args, trace, speed)
    base = summaries.get(BASELINE)
    name = f"static prefill={static}" if base is not None else None
    for way in ("serverless", "blitz"):
        mine = summaries.get(way)
        if mine is None:
            continue
        note = f"{common}; autoscale {way}, prefill 1..{args.max_prefill_replicas}; failed {mine.failed}"
        note += f" of {mine.requests}" + (f" (static {base.failed})" if base is not None else "")
        points = math.nan if base is None else (mine.attainment - base.attainment) * 100
        close = points >= -5.0
        yield row(BENCH, way, "slo_attainment", "higher", mine.attainment,
                  None if base is None else base.attainment, name,
                  note=f"{note}; goal within 5 points of static: {points:+.1f} points, {_goal(close)}")  # fmt: skip
        for metric, field in METRICS:
            yield row(BENCH, way, metric, "lower", getattr(mine, field),
                      None if base is None else getattr(base, field), name, unit="s", note=note)  # fmt: skip
        ratio = (
            math.nan
            if base is None or not base.replica_seconds
            else mine.replica_seconds / base.replica_seconds
        )
        goal = f"goal <= 0.7 x static with attainment within 5 points: {_goal(ratio <= 0.7 and close)}"
        yield row(BENCH, way, "replica_seconds", "lower", mine.replica_seconds,
                  None if base is None else base.replica_seconds, name, unit="replica-s",
                  note=f"{note}; mean replicas {mine.mean_replicas:.2f} over {mine.span:.1f} s; {goal}")  # fmt: skip
    blitz, serverless = summaries.get("blitz"), summaries.get("serverless")
    if blitz is not None and serverless is not None:
        met = blitz.ttft_p99 <= 0.5 * serverless.ttft_p99
        yield row(BENCH, "blitz-vs-serverless", "ttft_p99_s", "lower", blitz.ttft_p99, serverless.ttft_p99,
                  "serverless", unit="s", note=f"{common}; goal <= 0.5: {_goal(met)}")  # fmt: skip
