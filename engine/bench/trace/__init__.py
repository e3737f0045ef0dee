"""trace: the planner — reactive and with each predictor's floor — against static provisioning and an
oracle, on a production trace with emulated accelerators.

The trace (engine/bench/trace/gen.py): by default a 4-minute window of the vendored Azure LLM inference
trace 2023 (conversations; `--trace-offset` 1920 s, `--duration` 240 s, replayed at `--time-scale` 0.5
with `--length-scale` 0.25), or `--trace synthetic` (seeded Gamma arrivals with a burst), or
`--trace-csv FILE` (`--columns`). It is replayed open-loop (engine/bench/trace/replay.py: each request
sent at its arrival time, never waiting for replies) on one node process per way, tiny model,
`--max-batch-tokens` (512), every replica emulating an accelerator (`--emulated-speed`:
`--prefill-tokens-per-s` 2500 on azure-conv and 5000 otherwise, `--decode-steps-per-s` 50, a weight copy from host memory of
`--load-seconds` 2, from a peer replica `--peer-speedup` (8) times faster, from disk `--disk-slowdown` (8)
times slower — the ratios of NVLink, PCIe host-to-device and NVMe on an H100 SXM host, about 450, 55
and 7 GB/s). The ways (`--ways`, all by default):

- **static**: `--replicas prefill=N,decode=1`, no planner. N is the smallest count, from 1 up to
  `--max-prefill-replicas` (6), whose SLO attainment on the trace's peak (the `--peak-window`-second
  window with the most prompt tokens, replayed alone) reaches `--slo-target` (0.9); `--static-replicas N`
  skips that search.
- **reactive**: `--replicas prefill=1,decode=1 --autoscale --autoscale-policy blitz
  --autoscale-predictor none`: BlitzScale's band alone (prefill scales up with ZigZag, from a peer).
- **constant**, **ewma**, **kalman**, **periodic**: the same with that predictor's forecast as the floor.
- **serverless**: `--autoscale-policy serverless` (stop-the-world from the host copy) with the predictor
  of `--blitz-way` (kalman), against which that way's p99 TTFT is compared.
- **oracle**: no planner; a schedule of prefill counts made from the trace's known arrivals
  (engine/bench/trace/oracle.py), played through `scale` commands.

Every autoscaling way is told one replica's speed (`--prefill-tokens-per-s`) and the SLO, capped at
`--max-prefill-replicas`; `--planner-options` adds node options. Figures (engine/bench/trace/slo.py): SLO
attainment (TTFT ≤ max(`--slo-ttft-floor` 0.3 s, `--slo-ttft-per-token` × prompt tokens; by default
1.875 × one replica's emulated prefill time per token)), TTFT p50/p99,
replica-seconds (replicas not `Inactive` — loading, serving, draining — polled from `status` every 0.1
s, integrated from the trace's start to the last request's end) and scale events (the planner's
`scale_up`/`scale_down` decisions; the oracle's commands). Rows: each way against static, and the
`--blitz-way`'s p99 TTFT against serverless's. Goals: replica-seconds ≤ 0.55 × static with attainment
within 1 point of static's; blitz p99 TTFT ≤ 0.5 × serverless. A missed goal's note says where the
replica-seconds went (per role, loading, draining) and the oracle's figures.

`--plot FILE` draws the arrivals and each predictor's forecast, and the replicas of each way, over time
(engine/bench/trace/plot.py); `--logs DIR` keeps the nodes' logs.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Final

from engine.bench.rows import Row, row
from engine.bench.trace.bound import Bound, feasible_bound
from engine.bench.trace.gen import (
    TraceRequest,
    peak_window,
    prompt_tokens_per_s,
    source,
    trace_from,
    window,
    write_csv,
)
from engine.bench.trace.gen import add_arguments as add_trace_arguments
from engine.bench.trace.ideal import ideal_static
from engine.bench.trace.oracle import player, schedule
from engine.bench.trace.queueing import ReplicaModel, count_at, first_tokens
from engine.bench.trace.queueing import attainment as modelled_attainment
from engine.bench.trace.replay import Run, replay_on_node
from engine.bench.trace.slo import ReplicaSample, Slo, Summary, attainment, summarize

BENCH: Final = "trace"
BASELINE: Final = "static"
PREDICTORS: Final = ("constant", "ewma", "kalman", "periodic")
WAYS: Final = ("static", "reactive", *PREDICTORS, "serverless", "oracle")
UPPER: Final = 0.7  # the prefill band's upper utilisation (the planner's default), for the oracle
ORACLE_WINDOW_S: Final = 2.0
BOUND_WINDOW_S: Final = 1.0  # the feasible bound's schedules change count at most this often
MODEL_POINTS: Final = 2.0  # the queueing model's attainment within this many points of static's measured
ATTAINMENT_POINTS: Final = 1.0  # the goal: attainment within this many points of static's
SECONDS_GOAL: Final = 0.55  # ... at no more than this share of its replica-seconds
P99_GOAL: Final = 0.5  # blitz's p99 TTFT against serverless's
SLO_PREFILL_TIMES: Final = 1.875  # the TTFT SLO per prompt token, in one replica's prefill time per token
QUICK_WAYS: Final = "static,kalman,serverless,oracle"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trace_arguments(parser)
    group = parser.add_argument_group("the nodes and the SLO")
    group.add_argument(
        "--ways",
        default=None,
        help=f"comma-separated: {', '.join(WAYS)} (default: all; --quick: {QUICK_WAYS})",
    )
    group.add_argument(
        "--blitz-way",
        choices=("reactive", *PREDICTORS),
        default="kalman",
        help="the blitz way compared with serverless (and serverless's predictor; default kalman)",
    )
    group.add_argument(
        "--prefill-tokens-per-s", type=float, default=None, help="emulated (azure-conv 2500, else 5000)"
    )
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
        "--model-overhead-s",
        type=float,
        default=0.0,
        help="the queueing model's cost per prefill batch, beside the emulated speed (default 0)",
    )
    group.add_argument(
        "--model-host-s",
        type=float,
        default=0.0,
        help="the queueing model's cost per batch on the node's shared host, a batch at a time (default 0)",
    )
    group.add_argument(
        "--max-prefill-replicas", type=int, default=6, help="static search's, planner's and oracle's cap (6)"
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
    group.add_argument(
        "--slo-ttft-per-token",
        type=float,
        default=None,
        help="TTFT SLO per prompt token (default 1.875 / --prefill-tokens-per-s: 0.000375 at 5000)",
    )
    group.add_argument(
        "--no-planner-slo",
        dest="planner_slo",
        action="store_false",
        help="do not tell the planner the SLO (--autoscale-slo-ttft): it scales by its utilisation band alone",
    )
    group.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="draw arrivals, forecasts and replicas over time into this file",
    )
    group.add_argument("--logs", type=Path, default=None, help="keep the nodes' JSON logs in this folder")
    group.add_argument(
        "--quick", action="store_true", help="a 4 s synthetic trace, a 1.5 s burst, at most 2 replicas"
    )


def run(args: argparse.Namespace) -> Iterable[Row]:
    if args.quick:
        args.trace, args.duration, args.burst_at, args.burst_len = "synthetic", 4.0, 1.0, 1.5
        args.rate, args.max_prefill_replicas, args.load_seconds, args.peak_window = 3.0, 2, 0.5, 1.5
    chosen = args.ways if args.ways is not None else (QUICK_WAYS if args.quick else ",".join(WAYS))
    ways = [w.strip() for w in chosen.split(",") if w.strip()]
    unknown = set(ways) - set(WAYS)
    if unknown or not ways:
        raise SystemExit(f"--ways: unknown ways {sorted(unknown)} (ways: {', '.join(WAYS)})")
    try:
        trace = trace_from(args)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"trace: {exc}") from None
    if not trace:
        raise SystemExit("trace: no request in the trace")
    if args.save_trace is not None:
        write_csv(trace, args.save_trace)
    directory = Path(tempfile.mkdtemp(prefix="trace-bench-")) if args.logs is None else args.logs
    directory.mkdir(parents=True, exist_ok=True)
    try:
        yield from _rows(args, [w for w in WAYS if w in ways], trace, directory)
    finally:
        if args.logs is None:
            shutil.rmtree(directory, ignore_errors=True)


def node_options(
    args: argparse.Namespace,
    speed: str,
    *,
    prefill: int,
    policy: str | None,
    predictor: str = "none",
) -> list[str]:
    options = ["--replicas", f"prefill={prefill},decode=1", "--max-batch-tokens", str(args.max_batch_tokens)]
    options += ["--emulated-speed", speed]
    if policy is not None:
        options += ["--autoscale", "--autoscale-policy", policy, "--autoscale-predictor", predictor]
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


def way_options(args: argparse.Namespace, way: str, speed: str) -> list[str]:
    """The node options of an autoscaling way (or the oracle's: one prefill replica, no planner)."""
    if way == "oracle":
        return node_options(args, speed, prefill=1, policy=None)
    if way == "serverless":
        predictor = "none" if args.blitz_way == "reactive" else args.blitz_way
        return node_options(args, speed, prefill=1, policy="serverless", predictor=predictor)
    predictor = "none" if way == "reactive" else way
    return node_options(args, speed, prefill=1, policy="blitz", predictor=predictor)


def trace_speed(args: argparse.Namespace) -> str:
    """`--emulated-speed` of every way: `emulated_speed`'s, host at `--load-seconds`, peer and disk scaled."""
    from engine.bench.zigzag import emulated_speed
    from replicas.emulation import parse_emulated_speed

    if not (args.peer_speedup > 0 and args.disk_slowdown > 0):
        raise SystemExit("trace: --peer-speedup and --disk-slowdown must be > 0")
    if args.prefill_tokens_per_s is None:  # the trace's default
        args.prefill_tokens_per_s = 2500.0 if source(args) == "azure-conv" else 5000.0
    if args.slo_ttft_per_token is None:  # 1.875 × one replica's prefill time per token
        args.slo_ttft_per_token = SLO_PREFILL_TIMES / args.prefill_tokens_per_s
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


def oracle_plan(args: argparse.Namespace, trace: Sequence[TraceRequest]) -> list[tuple[float, int]]:
    """The oracle's schedule: lead = a copy from a peer (`--load-seconds` / `--peer-speedup`) + 0.1 s."""
    return schedule(
        trace,
        capacity=args.prefill_tokens_per_s,
        upper=UPPER,
        window=ORACLE_WINDOW_S,
        lead=args.load_seconds / args.peer_speedup + 0.1,
        minimum=1,
        maximum=args.max_prefill_replicas,
    )


def decisions(log_file: Path) -> list[dict[str, object]]:
    """The `planner_decision` events of a node's log."""
    if not log_file.exists():
        return []
    found = []
    for line in log_file.read_bytes().splitlines():
        if b'"planner_decision"' in line:
            event = json.loads(line)
            if event.get("event") == "planner_decision":
                found.append(event)
    return found


def scale_events(log_file: Path) -> int:
    return sum(
        d["action"] in ("scale_up", "scale_down") and not d.get("advisory") for d in decisions(log_file)
    )


def _rows(
    args: argparse.Namespace, ways: list[str], trace: Sequence[TraceRequest], directory: Path
) -> Iterator[Row]:
    speed = trace_speed(args)
    slo = Slo(args.slo_ttft_floor, args.slo_ttft_per_token)
    runs: dict[str, Run] = {}
    summaries: dict[str, Summary] = {}
    events: dict[str, int] = {}
    static = args.static_replicas
    plan: list[tuple[float, int]] = []
    for way in ways:
        control = None
        if way == BASELINE:
            if static is None:
                static, note = find_static(args, trace, speed, directory, slo)
            else:
                note = "given by --static-replicas"
            _say(f"static: {static} prefill replica(s)")
            yield row(BENCH, BASELINE, "prefill_replicas", "lower", float(static), note=note)
            options = node_options(args, speed, prefill=static, policy=None)
        else:
            options = way_options(args, way, speed)
            if way == "oracle":
                plan = oracle_plan(args, trace)
                control = player(plan, args.keep_alive if args.keep_alive is not None else 0.333)
        log_file = directory / f"{way}.jsonl"
        runs[way] = replay_on_node(trace, options, log_file, args.seed, control)
        summaries[way] = summary = summarize(runs[way].outcomes, runs[way].samples, slo)
        events[way] = max(0, len(plan) - 1) if way == "oracle" else scale_events(log_file)
        _say(
            f"{way}: attainment {summary.attainment:.1%}, TTFT p50/p99 {summary.ttft_p50:.3f}/"
            f"{summary.ttft_p99:.3f} s, {summary.replica_seconds:.1f} replica-s over {summary.span:.1f} s, "
            f"{events[way]} scale events, {summary.failed} failed"
        )
    samples = {way: run.samples for way, run in runs.items()}
    yield from _way_rows(args, trace, speed, summaries, events, static, samples)
    if args.plot is not None and runs:
        from engine.bench.trace.plot import draw

        labels = {w: (f"static (prefill={static})" if w == BASELINE else w) for w in runs}
        forecasts = {w: decisions(directory / f"{w}.jsonl") for w in runs if w in PREDICTORS}
        draw(
            trace,
            {labels[w]: r for w, r in runs.items()},
            {w: (runs[w].started_wall, d) for w, d in forecasts.items()},
            args.plot,
            title=_title(args),
            subtitle=f"emulated: {speed}",
        )


def _bound(args: argparse.Namespace, trace: Sequence[TraceRequest], base: Summary, static: int) -> Bound:
    """The feasible bound (engine/bench/trace/bound.py) for static's modelled attainment at `static`."""
    slo = Slo(args.slo_ttft_floor, args.slo_ttft_per_token)
    replica = ReplicaModel(
        args.prefill_tokens_per_s, args.max_batch_tokens, args.model_overhead_s, args.model_host_s
    )
    ordered = sorted(trace, key=lambda r: r.at)
    target = modelled_attainment(ordered, first_tokens(ordered, ((0.0, static),), replica), slo)
    return feasible_bound(
        ordered,
        replica,
        slo,
        target=target,
        span=base.span,
        window=BOUND_WINDOW_S,
        lead=args.load_seconds / args.peer_speedup + 0.1,
        cap=args.max_prefill_replicas,
    )


def late_loading(samples: Sequence[ReplicaSample], counts: Sequence[tuple[float, int]], span: float) -> float:
    """Replica-seconds of prefill replicas loading while those already serving met the bound's count at
    that time (`counts`): scale-ups that arrived after the need passed."""
    ordered = sorted(samples, key=lambda s: s.at)
    total = 0.0
    for index, sample in enumerate(ordered):
        end = min(ordered[index + 1].at if index + 1 < len(ordered) else span, span)
        if (
            end > sample.at
            and sample.loading
            and sample.prefill - sample.loading >= count_at(counts, sample.at)
        ):
            total += sample.loading * (end - sample.at)
    return total


def _bound_rows(
    args: argparse.Namespace,
    bound: Bound,
    summaries: dict[str, Summary],
    static: int,
    common: str,
) -> Iterator[Row]:
    """The queueing model at static's count against static's measured attainment (the model's check),
    and the feasible bound against static's replica-seconds; the bound's note names any way that
    measured at least static's attainment on fewer replica-seconds (it should be none: such a way would
    show the bound wrong)."""
    base = summaries[BASELINE]
    target = bound.target
    points = (target - base.attainment) * 100
    model = (
        f"queueing model: {static} replicas, {args.prefill_tokens_per_s:g} tokens/s, batches of "
        f"{args.max_batch_tokens} tokens, {args.model_overhead_s:g} s a batch, {args.model_host_s:g} s of the host"
    )
    yield row(BENCH, "bound", "slo_attainment_model", "higher", target, base.attainment,
              f"static prefill={static}, measured",
              note=f"{common}; {model}; within {MODEL_POINTS:g} points of the measured: {points:+.1f} points, "
              f"{_goal(abs(points) <= MODEL_POINTS)}")  # fmt: skip
    lead = args.load_seconds / args.peer_speedup + 0.1
    total = bound.replica_seconds + base.spent.decode  # the decode replica, as static measured it
    beaten = [
        f"{way} ({mine.replica_seconds:.0f} replica-s, {mine.attainment:.1%})"
        for way, mine in summaries.items()
        if mine.attainment >= base.attainment and mine.replica_seconds < total
    ]
    yield row(BENCH, "bound", "replica_seconds", "lower", total, base.replica_seconds,
              f"static prefill={static}", unit="replica-s",
              note=f"{common}; the fewest replica-seconds of a schedule meeting static's modelled attainment "
              f"({target:.1%}) under the {model.split(':')[0]}: prefill counts per {BOUND_WINDOW_S:g} s "
              f"{_steps(bound.counts)}, {bound.loading_seconds:.1f} replica-s loading ({lead:.2f} s a "
              f"replica), plus the decode replica's {base.spent.decode:.0f}; ways below it at static's "
              f"attainment: {', '.join(beaten) or 'none'}")  # fmt: skip


def _steps(counts: Sequence[tuple[float, int]]) -> str:
    shown = " ".join(f"{at:g}s:{n}" for at, n in counts[:12])
    return shown + (f" … ({len(counts)} steps)" if len(counts) > 12 else "")


def _goal(met: bool) -> str:
    return "met" if met else "missed"


def _title(args: argparse.Namespace) -> str:
    kind = source(args)
    if kind == "synthetic":
        return "A synthetic bursty trace: the planner's ways against static provisioning"
    name = "Azure LLM inference trace 2023, conversations" if kind == "azure-conv" else args.trace_csv.name
    end = args.trace_offset + args.duration
    return f"{name} [{args.trace_offset:g}, {end:g}) s, x{args.time_scale:g} time: the planner's ways"


def _describe(args: argparse.Namespace, trace: Sequence[TraceRequest], speed: str) -> str:
    kind = source(args)
    if kind == "synthetic":
        what = (
            f"synthetic: Gamma cv {args.cv:g} at {args.rate:g} req/s, x{args.burst_factor:g} in "
            f"[{args.burst_at:g}, {args.burst_at + args.burst_len:g}) s"
        )
    else:
        name = "azure-conv" if kind == "azure-conv" else f"CSV {args.trace_csv.name}"
        what = (
            f"{name} [{args.trace_offset:g}, {args.trace_offset + args.duration:g}) s of the trace, time "
            f"x{args.time_scale:g}, lengths x{args.length_scale:g}"
        )
    last = max((r.at for r in trace), default=0.0)
    return (
        f"{len(trace)} requests over {last:.0f} s ({what}); emulated ({speed}); SLO TTFT <= "
        f"max({args.slo_ttft_floor:g} s, {args.slo_ttft_per_token:g} s x prompt tokens)"
    )


def _where(mine: Summary, oracle: Summary | None, base: Summary | None) -> str:
    """Where the replica-seconds went, and the oracle's figures beside them."""
    spent = mine.spent
    text = (
        f"replica-s: prefill {spent.prefill:.0f}, decode {spent.decode:.0f}; of both, loading "
        f"{spent.loading:.0f}, draining {spent.draining:.0f}"
    )
    if oracle is not None:
        ratio = (
            oracle.replica_seconds / base.replica_seconds
            if base is not None and base.replica_seconds
            else math.nan
        )
        text += (
            f"; oracle {oracle.replica_seconds:.0f} replica-s ({ratio:.2f} x static), attainment "
            f"{oracle.attainment:.1%}, prefill {oracle.spent.prefill:.0f}"
        )
    return text


def _way_rows(
    args: argparse.Namespace,
    trace: Sequence[TraceRequest],
    speed: str,
    summaries: dict[str, Summary],
    events: dict[str, int],
    static: int | None,
    samples: dict[str, list[ReplicaSample]],
) -> Iterator[Row]:
    """Each way against static (when it ran), then the blitz way's p99 TTFT against serverless's."""
    common = _describe(args, trace, speed)
    base = summaries.get(BASELINE)
    oracle = summaries.get("oracle")
    found: Bound | None = None
    name = f"static prefill={static}" if base is not None else None
    if base is not None:
        yield row(BENCH, BASELINE, "replica_seconds", "lower", base.replica_seconds, unit="replica-s",
                  note=f"{common}; attainment {base.attainment:.1%}, TTFT p50/p99 {base.ttft_p50:.3f}/"
                  f"{base.ttft_p99:.3f} s")  # fmt: skip
        # Static's own figures against the ideal model of the same arrivals (engine/bench/trace/ideal.py);
        # `engine.bench compare` sets them against another tree's.
        ideal = ideal_static(
            trace, static or 1, args.prefill_tokens_per_s, Slo(args.slo_ttft_floor, args.slo_ttft_per_token)
        )
        model = f"ideal: {static} replicas, FCFS, each prompt at the emulated speed"
        yield row(BENCH, BASELINE, "slo_attainment", "higher", base.attainment, ideal[0], model, note=common)
        for metric, measured, bound in (
            ("ttft_p50_s", base.ttft_p50, ideal[1]),
            ("ttft_p99_s", base.ttft_p99, ideal[2]),
        ):
            yield row(BENCH, BASELINE, metric, "lower", measured, bound, model, unit="s", note=common)
        found = _bound(args, trace, base, static or 1)
        yield from _bound_rows(args, found, summaries, static or 1, common)
    for way in WAYS:
        mine = summaries.get(way)
        if mine is None or way == BASELINE:
            continue
        what = {
            "oracle": "oracle: a schedule from the known arrivals, played through scale",
            "reactive": "blitz, reactive only",
            "serverless": f"serverless, predictor {'none' if args.blitz_way == 'reactive' else args.blitz_way}",
        }.get(way, f"blitz, predictor {way} as the floor")
        note = f"{common}; {what}, prefill 1..{args.max_prefill_replicas}; failed {mine.failed} of {mine.requests}"
        points = math.nan if base is None else (mine.attainment - base.attainment) * 100
        close = points >= -ATTAINMENT_POINTS
        yield row(BENCH, way, "slo_attainment", "higher", mine.attainment,
                  None if base is None else base.attainment, name,
                  note=f"{note}; goal within {ATTAINMENT_POINTS:g} point of static: {points:+.1f} points, "
                  f"{_goal(close)}")  # fmt: skip
        for metric, field in (("ttft_p50_s", "ttft_p50"), ("ttft_p99_s", "ttft_p99")):
            yield row(BENCH, way, metric, "lower", getattr(mine, field),
                      None if base is None else getattr(base, field), name, unit="s", note=note)  # fmt: skip
        ratio = (
            math.nan
            if base is None or not base.replica_seconds
            else mine.replica_seconds / base.replica_seconds
        )
        met = ratio <= SECONDS_GOAL and close
        goal = f"goal <= {SECONDS_GOAL:g} x static with attainment within {ATTAINMENT_POINTS:g} point: {_goal(met)}"
        where = "" if met else f"; {_where(mine, None if way == 'oracle' else oracle, base)}"
        yield row(BENCH, way, "replica_seconds", "lower", mine.replica_seconds,
                  None if base is None else base.replica_seconds, name, unit="replica-s",
                  note=f"{note}; mean replicas {mine.mean_replicas:.2f} over {mine.span:.1f} s; {goal}{where}")  # fmt: skip
        yield row(BENCH, way, "scale_events", "lower", float(events.get(way, 0)), unit="events", note=note)
        if found is not None and way in samples:
            late = late_loading(samples[way], found.counts, mine.span)
            yield row(BENCH, way, "late_loading_replica_s", "lower", late, unit="replica-s",
                      note=f"{note}; prefill replicas loading while those serving already met the bound's "
                      f"count: scale-ups that came after the need passed; of {mine.spent.loading:.1f} "
                      f"replica-s loading in all")  # fmt: skip
    blitz, serverless = summaries.get(args.blitz_way), summaries.get("serverless")
    if blitz is not None and serverless is not None:
        met = blitz.ttft_p99 <= P99_GOAL * serverless.ttft_p99
        yield row(BENCH, "blitz-vs-serverless", "ttft_p99_s", "lower", blitz.ttft_p99, serverless.ttft_p99,
                  "serverless", unit="s",
                  note=f"{common}; blitz: {args.blitz_way}; goal <= {P99_GOAL:g}: {_goal(met)}")  # fmt: skip
