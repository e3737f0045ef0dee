"""zigzag: scaling prefill up at a 3× burst, ZigZag against stop-the-world; the weight copy's speed.

TTFT at a burst (cases `burst3x-emulated`, `burst3x-uncapped`; `burst3x-deep-…` with `--ttft-model deep`,
the tiny model's width with 16 layers, so a copy lands in 16 steps). One seeded trace: Poisson arrivals at
`--rate` requests/s, tripled from `--burst-at` seconds to the end of `--duration`; prompts of
`--prompt-min`–`--prompt-max` random tokens, `--max-tokens` generated (`ignore_eos`). Each way is its own
node process (`python -m engine.node --replicas prefill=1,decode=1 --max-batch-tokens 512`, tiny model;
`--no-old-prefill-serves-queue` passes that option on) driven through its control socket on the same
trace; when the burst starts the client sends `scale {role: prefill, replicas: 2, source: host}` with
`mode: zigzag` (the project) or `mode: stop_the_world` (the baseline).
Rows: p50 and p99 TTFT (the node's `timings.ttft_s`) of the requests arriving in the first `--window`
seconds of the burst, pooled over `--repeats` runs of each way. `-emulated`: the nodes run with
`--emulated-speed` (replicas/emulation.py: every real compute and weight copy is padded with a sleep to
an emulated accelerator's time): prefill `--prefill-tokens-per-s` (one replica copes with the steady
rate and saturates at the tripled one), decode `--decode-steps-per-s`, and a weight copy of
`--load-seconds`. `-uncapped`: the same without emulation (on the CPU the copy takes milliseconds).

Weight copy (cases `weights_copy_{peer,host,disk}`, `_100m` with `--copy-model 100m`; `--only copy`): one
uncapped node; a second prefill replica is scaled up (`stop_the_world`) with each `source` in turn and
released (`Inactive`) again, and the node's `weights_copy_finished` event gives bytes / seconds
(engine/bench/zigzag/copy.py); baselines are raw copies of the same bytes on the same path in the
benchmark's process. `--hosts 2`: a peer copy between two nodes on two hosts against raw TCP between them
(`weights_copy_peer_hosts`, engine/bench/zigzag/hosts.py).

`--hosts 3` (`--only ttft`): the emulated burst on three hosts — prefill on one, decode on another, the
third empty until the scale places the new prefill replica there, its weights from a peer
(`burst3x-hosts3-emulated`, engine/bench/zigzag/hosts.py).

Multicast chain (`--only chain`, case `weights_chain_3`): three replicas one `scale` loads from one peer
against one, on one node with emulated peer copies (`--chain-gb-per-s`), or with `--hosts 2` on a
second host whose source's link is shaped to `--chain-mbit` (`weights_chain_3_hosts`).

`--plot FILE` draws TTFT around the scale of the last emulated runs (engine/bench/zigzag/plot.py); `--logs
DIR` keeps the nodes' logs.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import trio

from engine.bench.nodes import node_process
from engine.bench.rows import Row, row
from engine.bench.zigzag.ideal import MODEL_WAYS, Copy, ModelWay, Prompt, ttfts
from messages.control import ScaleMode

BENCH: Final = "zigzag"
PROJECT: Final = "zigzag"
BASELINE: Final = "stop_the_world"
MODES: Final[tuple[ScaleMode, ScaleMode]] = (BASELINE, PROJECT)  # the order the runs alternate in
SERVE_SECONDS: Final = 60.0  # a node's replicas load before the trace starts


@dataclass(frozen=True, slots=True)
class Arrival:
    at: float  # seconds from the trace's start
    prompt: list[int]


@dataclass(frozen=True, slots=True)
class Sample:
    at: float
    ttft: float | None  # None: the request failed (`error`)
    relay_layer: int | None
    error: str | None


@dataclass(frozen=True, slots=True)
class Way:
    mode: ScaleMode
    emulated: str | None  # the --emulated-speed value; None: uncapped
    model: str = "tiny"  # the node's --model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--only", default="ttft,copy", help="comma-separated: ttft, copy, chain (default ttft,copy)"
    )
    parser.add_argument(
        "--chain-gb-per-s", type=float, default=0.005, help="--only chain: the emulated peer speed (0.005)"
    )
    parser.add_argument(
        "--chain-mbit", type=float, default=40.0, help="--only chain --hosts 2: the source's link (40 Mbit/s)"
    )
    parser.add_argument(
        "--rate", type=float, default=4.0, help="steady requests/s (default 4; ×3 at the burst)"
    )
    parser.add_argument("--duration", type=float, default=6.0, help="seconds of the trace (default 6)")
    parser.add_argument("--burst-at", type=float, default=2.0, help="the burst's start, s (default 2)")
    parser.add_argument("--window", type=float, default=3.0, help="the burst's measured seconds (default 3)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each way (default 2)")
    parser.add_argument("--prompt-min", type=int, default=64)
    parser.add_argument("--prompt-max", type=int, default=192)
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request (default 4)")
    parser.add_argument(
        "--max-batch-tokens", type=int, default=512, help="the nodes' prompt tokens per prefill batch (512)"
    )
    parser.add_argument(
        "--old-prefill-serves-queue",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the nodes' option of that name (default: on, the node's default)",
    )
    parser.add_argument("--prefill-tokens-per-s", type=float, default=1000.0, help="emulated (default 1000)")
    parser.add_argument("--decode-steps-per-s", type=float, default=100.0, help="emulated (default 100)")
    parser.add_argument("--load-seconds", type=float, default=1.5, help="emulated weight copy (default 1.5)")
    parser.add_argument("--copy-repeats", type=int, default=9, help="weight copies per source (default 9)")
    parser.add_argument(
        "--ttft-model",
        choices=["tiny", "deep"],
        default="tiny",
        help="the TTFT runs' model: tiny (4 layers, default) or deep (its width, 16 layers: a copy lands in 16 steps)",
    )
    parser.add_argument(
        "--copy-model",
        choices=["tiny", "small", "100m"],
        default="tiny",
        help="the weight copy's model: tiny (default) or a random Llama checkpoint (100m: 0.4 GB)",
    )
    parser.add_argument(
        "--copy-device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the node serves for the copy rows: cuda gives `_cuda` rows against a pinned host-to-device "
        "copy (host) and a device-to-device copy (peer), the GPU named",
    )
    parser.add_argument(
        "--hosts",
        type=int,
        default=1,
        help="2: the copy and chain rows across two hosts (network namespaces; a peer copy against raw TCP); "
        "3: the burst (ttft) on three hosts, the new prefill replica on an empty one; engine/bench/zigzag/hosts.py",
    )
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--plot", type=Path, default=None, help="draw TTFT around the scale into this file")
    parser.add_argument("--logs", type=Path, default=None, help="keep the nodes' JSON logs in this folder")
    parser.add_argument("--quick", action="store_true", help="a 2 s trace, one run of each, one copy each")


def run(args: argparse.Namespace) -> Iterable[Row]:
    if args.quick:
        args.duration, args.burst_at, args.window, args.repeats, args.copy_repeats = 2.0, 1.0, 1.0, 1, 1
    only = {part.strip() for part in args.only.split(",") if part.strip()}
    unknown = only - {"ttft", "copy", "chain"}
    if unknown:
        raise SystemExit(f"--only: unknown groups {sorted(unknown)} (groups: ttft, copy, chain)")
    directory = Path(tempfile.mkdtemp(prefix="zigzag-bench-")) if args.logs is None else args.logs
    directory.mkdir(parents=True, exist_ok=True)
    try:
        if "ttft" in only and args.hosts == 3:
            yield from _host_ttft_rows(args, directory)
        elif "ttft" in only:
            yield from _ttft_rows(args, directory)
        if "copy" in only and args.hosts > 1:
            from engine.bench.zigzag.hosts import host_copy_rows

            yield from host_copy_rows(args, directory)
        elif "copy" in only:
            from engine.bench.zigzag.copy import copy_rows

            yield from copy_rows(args, directory)
        if "chain" in only and args.hosts > 1:
            from engine.bench.zigzag.hosts import host_chain_rows

            yield from host_chain_rows(args, directory)
        elif "chain" in only:
            from engine.bench.zigzag.copy import chain_rows

            yield from chain_rows(args, directory)
    finally:
        if args.logs is None:
            shutil.rmtree(directory, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- the trace
def make_trace(args: argparse.Namespace) -> list[Arrival]:
    """Seeded Poisson arrivals, `rate` before `burst_at` and 3 × `rate` after it, with their prompts."""
    rng = random.Random(args.seed)
    arrivals: list[Arrival] = []
    at = 0.0
    while True:
        at += rng.expovariate(args.rate * (3.0 if at >= args.burst_at else 1.0))
        if at >= args.duration:
            return arrivals
        length = rng.randint(args.prompt_min, args.prompt_max)
        arrivals.append(Arrival(at, [rng.randrange(1, 256) for _ in range(length)]))


def emulated_speed(args: argparse.Namespace, model: str = "tiny") -> str:
    from replicas.loading.pieces import model_bytes
    from replicas.model import read_hf_config
    from replicas.model.tiny import TINY_CONFIG

    config = TINY_CONFIG if model == "tiny" else read_hf_config(model)
    weights_gb_per_s = model_bytes(config) / args.load_seconds / 1e9
    return (
        f"prefill_tokens_per_s={args.prefill_tokens_per_s:g},decode_steps_per_s={args.decode_steps_per_s:g},"
        f"weights_gb_per_s={weights_gb_per_s:.6g}"
    )


def _ttft_rows(args: argparse.Namespace, directory: Path) -> Iterator[Row]:
    from engine.bench.e2e import _model_source

    with _model_source(args.ttft_model) as model:
        yield from _ttft_rows_of(args, directory, model)


def _ttft_rows_of(args: argparse.Namespace, directory: Path, model: str) -> Iterator[Row]:
    trace = make_trace(args)
    speed = emulated_speed(args, model)
    name = "burst3x" if args.ttft_model == "tiny" else f"burst3x-{args.ttft_model}"
    cases = {f"{name}-emulated": speed, f"{name}-uncapped": None}
    samples: dict[tuple[str, ScaleMode], list[Sample]] = {}
    last_logs: dict[ScaleMode, Path] = {}
    copies: dict[ScaleMode, list[Copy]] = {}  # the emulated runs' copies of the new replica
    for repeat in range(args.repeats):
        for case, emulated in cases.items():
            for mode in MODES:
                log_file = directory / f"{case}-{mode}-{repeat + 1}.jsonl"
                log_file.unlink(missing_ok=True)
                found, started_wall = run_way(trace, Way(mode, emulated, model), log_file, args)
                samples.setdefault((case, mode), []).extend(found)
                if emulated is not None:
                    last_logs[mode] = log_file
                    copies.setdefault(mode, []).append(new_replica_copy(log_file, started_wall))
    start, stop = args.burst_at, args.burst_at + args.window
    for case, emulated in cases.items():
        window = {
            mode: [s for s in samples[(case, mode)] if start <= s.at < stop] for mode in (PROJECT, BASELINE)
        }
        mine, theirs = window[PROJECT], window[BASELINE]
        failed = {mode: sum(s.ttft is None for s in window[mode]) for mode in window}
        relayed = sum(s.relay_layer is not None for s in samples[(case, PROJECT)])
        note = (
            f"{'emulated (' + emulated + ')' if emulated else 'uncapped (no emulation)'}; {args.ttft_model} model, "
            f"prefill=1,decode=1 scaled to prefill=2 (source host) at {args.burst_at:g} s as the rate goes "
            f"{args.rate:g} -> {3 * args.rate:g} req/s; requests arriving in [{start:g}, {stop:g}) s: "
            f"{len(mine) // max(1, args.repeats)} per run, {args.repeats} run(s) of each way; requests relayed "
            f"in the zigzag runs: {relayed}; failed: zigzag {failed[PROJECT]}, stop_the_world {failed[BASELINE]}"
        )
        for quantile, goal in ((0.5, ""), (0.99, "; goal <= 0.5")):
            project = _quantile([s.ttft for s in mine if s.ttft is not None], quantile)
            baseline = _quantile([s.ttft for s in theirs if s.ttft is not None], quantile)
            yield row(BENCH, case, f"ttft_p{int(quantile * 100)}_s", "lower", project, baseline, BASELINE,
                      unit="s", note=note + (goal if emulated else ""))  # fmt: skip
    yield from _model_rows(args, trace, name, samples, copies)
    if args.plot is not None and len(last_logs) == 2:
        from engine.bench.zigzag.plot import draw_ttft

        draw_ttft(
            {"stop-the-world": last_logs[BASELINE], "ZigZag": last_logs[PROJECT]},
            args.plot,
            subtitle=f"emulated: {speed}; rate {args.rate:g} -> {3 * args.rate:g} req/s",
        )


def _host_ttft_rows(args: argparse.Namespace, directory: Path) -> Iterator[Row]:
    """`--hosts 3`: the emulated burst on three hosts (engine/bench/zigzag/hosts.py), the new replica's
    weights from a peer at the emulated speed; ZigZag runs first, so that a ZigZag scale onto the empty
    node that is refused is found before any stop-the-world run, and both ways then scale onto the
    serving node."""
    from engine.bench.e2e import _model_source

    with _model_source(args.ttft_model) as model:
        yield from _host_ttft_rows_of(args, directory, model)


def _host_ttft_rows_of(args: argparse.Namespace, directory: Path, model: str) -> Iterator[Row]:
    from engine.bench.zigzag.hosts import PairingRefused, burst_hosts_run

    trace = [(a.at, a.prompt) for a in make_trace(args)]
    speed = emulated_speed(args, model)
    peer_speed = speed.rpartition("weights_gb_per_s=")[2]
    options = [
        "--model",
        model,
        "--max-batch-tokens",
        str(args.max_batch_tokens),
        "--emulated-speed",
        f"{speed},peer_gb_per_s={peer_speed}",
    ]
    if not args.old_prefill_serves_queue:
        options.append("--no-old-prefill-serves-queue")
    layout = "cross"
    why = "pre prefill=1 on a, dec decode=1 on b, cap empty on c; the scale onto cap (a pair across nodes)"
    samples: dict[ScaleMode, list[Sample]] = {PROJECT: [], BASELINE: []}
    pairs: set[str] = set()
    for repeat in range(args.repeats):
        for mode in (PROJECT, BASELINE):
            while True:
                run_dir = directory / f"burst-hosts3-{mode}-{repeat + 1}"
                shutil.rmtree(run_dir, ignore_errors=True)
                try:
                    outcomes, paired = burst_hosts_run(trace, mode, layout, options, run_dir, args)
                except PairingRefused as exc:
                    layout = "within"
                    why = (
                        "pre prefill=1,decode=1 on a, dec decode=1 on b, cap empty on c; the scale onto pre (a pair "
                        f"within pre: ZigZag onto the empty cap was refused: {exc})"
                    )
                    continue
                break
            samples[mode].extend(Sample(*outcome) for outcome in outcomes)
            pairs.update(paired)
    start, stop = args.burst_at, args.burst_at + args.window
    window = {mode: [s for s in samples[mode] if start <= s.at < stop] for mode in samples}
    failed = {mode: sum(s.ttft is None for s in window[mode]) for mode in window}
    relayed = sum(s.relay_layer is not None for s in samples[PROJECT])
    note = (
        f"emulated ({speed}, peer the same); {args.ttft_model} model; three hosts (network namespaces on a bridge, --transport tcp): "
        f"{why}; scale prefill +1 at {args.burst_at:g} s, source peer, as the rate goes {args.rate:g} -> {3 * args.rate:g} req/s; pairs (new <- old): "
        f"{', '.join(sorted(pairs)) or 'none'}; requests arriving in [{start:g}, {stop:g}) s: "
        f"{len(window[PROJECT]) // max(1, args.repeats)} per run, {args.repeats} run(s) of each way; relayed in "
        f"the zigzag runs: {relayed}; failed: zigzag {failed[PROJECT]}, stop_the_world {failed[BASELINE]}"
    )
    for quantile, goal in ((0.5, ""), (0.99, "; goal <= 0.5")):
        project = _quantile([s.ttft for s in window[PROJECT] if s.ttft is not None], quantile)
        baseline = _quantile([s.ttft for s in window[BASELINE] if s.ttft is not None], quantile)
        case = (
            "burst3x-hosts3-emulated"
            if args.ttft_model == "tiny"
            else f"burst3x-hosts3-{args.ttft_model}-emulated"
        )
        yield row(BENCH, case, f"ttft_p{int(quantile * 100)}_s", "lower", project,
                  baseline, BASELINE, unit="s", note=note + goal)  # fmt: skip


def new_replica_copy(log_file: Path, started_wall: float) -> Copy:
    """The copy of the replica the scale added (`prefill-1`) as the run's log has it: when it started and
    when each layer landed, in seconds from the trace's start."""
    scale_at, layers = None, []
    with log_file.open(encoding="utf-8") as lines:
        for line in lines:
            event = json.loads(line)
            if event.get("replica") != "prefill-1":
                continue
            if event["event"] == "weights_copy_started" and scale_at is None:
                scale_at = event["ts"] - started_wall
            elif event["event"] == "weights_progress" and event.get("piece") == "layer":
                layers.append(event["ts"] - started_wall)
    if scale_at is None or not layers:
        raise RuntimeError(
            f"{log_file}: no copy of prefill-1 in the log (weights_copy_started, weights_progress)"
        )
    return Copy(scale_at, tuple(sorted(layers)))


def _model_rows(
    args: argparse.Namespace,
    trace: list[Arrival],
    name: str,
    samples: dict[tuple[str, ScaleMode], list[Sample]],
    copies: dict[ScaleMode, list[Copy]],
) -> Iterator[Row]:
    """The emulated runs against the ideal models of the same arrivals (engine/bench/zigzag/ideal.py):
    measured ZigZag against ideal ZigZag and against an instant copy, measured stop-the-world against its
    model — each model run once per run, with that run's own copy, pooled like the measurements."""
    if PROJECT not in copies or BASELINE not in copies:
        return
    prompts = [Prompt(a.at, len(a.prompt)) for a in trace]
    start, stop = args.burst_at, args.burst_at + args.window
    in_window = [index for index, p in enumerate(sorted(prompts, key=lambda p: p.at)) if start <= p.at < stop]
    modelled: dict[ModelWay, list[float]] = {way: [] for way in MODEL_WAYS}
    for way in MODEL_WAYS:
        for copy in copies[BASELINE if way == "stop_the_world" else PROJECT]:
            times = ttfts(prompts, copy, speed=args.prefill_tokens_per_s, way=way)
            modelled[way].extend(times[index] for index in in_window)
    case = f"{name}-emulated"
    measured = {
        mode: [s.ttft for s in samples[(case, mode)] if start <= s.at < stop and s.ttft is not None]
        for mode in (PROJECT, BASELINE)
    }
    layers = len(copies[PROJECT][0].layer_times)
    copy_s = statistics.median(c.done - c.scale_at for c in copies[PROJECT])
    note = (
        f"the ideal models (engine/bench/zigzag/ideal.py) of the same arrivals at {args.prefill_tokens_per_s:g} "
        f"prompt tokens/s, each run's own copy ({layers} layers, {copy_s:.2f} s median), no overheads; "
        f"model p50/p99: stop-the-world {_quantile(modelled['stop_the_world'], 0.5):.3f}/"
        f"{_quantile(modelled['stop_the_world'], 0.99):.3f} s, instant {_quantile(modelled['instant'], 0.5):.3f}/"
        f"{_quantile(modelled['instant'], 0.99):.3f} s, ideal zigzag {_quantile(modelled['ideal_zigzag'], 0.5):.3f}/"
        f"{_quantile(modelled['ideal_zigzag'], 0.99):.3f} s"
    )
    against: tuple[tuple[str, ScaleMode, ModelWay, str, str], ...] = (
        (f"{case}-vs-ideal", PROJECT, "ideal_zigzag", "ideal-zigzag-model", "; goal p99 <= 1.25"),
        (f"{case}-vs-instant", PROJECT, "instant", "instant-model", ""),
        (f"{case}-stw-vs-model", BASELINE, "stop_the_world", "stop-the-world-model", ""),
    )
    for row_case, mode, model_way, model_name, goal in against:
        for quantile in (0.5, 0.99):
            yield row(BENCH, row_case, f"ttft_p{int(quantile * 100)}_s", "lower",
                      _quantile(measured[mode], quantile), _quantile(modelled[model_way], quantile), model_name,
                      unit="s", note=note + (goal if quantile == 0.99 else ""))  # fmt: skip


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


# ---------------------------------------------------------------------------------------------- one run
def run_way(
    trace: list[Arrival], way: Way, log_file: Path, args: argparse.Namespace
) -> tuple[list[Sample], float]:
    """One node process running `trace`, scaled up `way.mode` at the burst; the samples of every request,
    and the wall-clock time the trace started (`time.time()`: the log's clock)."""
    options = ["--replicas", "prefill=1,decode=1", "--max-batch-tokens", str(args.max_batch_tokens)]
    options += ["--model", way.model]
    if not args.old_prefill_serves_queue:
        options.append("--no-old-prefill-serves-queue")
    if way.emulated is not None:
        options += ["--emulated-speed", way.emulated]
    with node_process(log_file, options) as address:
        return trio.run(_drive, address, trace, way.mode, args)


async def _drive(
    address: str, trace: list[Arrival], mode: ScaleMode, args: argparse.Namespace
) -> tuple[list[Sample], float]:
    from engine.client import ControlClient, ControlError

    samples: list[Sample] = []
    async with ControlClient.connect(address) as client:
        with trio.fail_after(SERVE_SECONDS):
            while not all(r.state in ("Prefill", "Decode") for r in (await client.status()).replicas):  # noqa: ASYNC110
                await trio.sleep(0.05)
        for arrival in trace[:2]:  # warm-up, unrecorded: first-call costs of the serving replicas
            await client.generate_result(
                input_ids=arrival.prompt, max_tokens=args.max_tokens, ignore_eos=True
            )
        started = trio.current_time() + 0.1
        started_wall = time.time() + 0.1

        async def scale() -> None:
            await trio.sleep_until(started + args.burst_at)
            result = await client.scale("prefill", 2, mode=mode, source="host")
            if [s.mode for s in result.started] != [mode]:
                raise RuntimeError(f"scale {mode}: the node started {result.started}")

        async def one(arrival: Arrival) -> None:
            await trio.sleep_until(started + arrival.at)
            try:
                result = await client.generate_result(
                    input_ids=arrival.prompt, max_tokens=args.max_tokens, ignore_eos=True
                )
            except ControlError as exc:
                samples.append(Sample(arrival.at, None, None, exc.code))
                return
            layer = None if result.relay is None else result.relay.layer
            samples.append(Sample(arrival.at, result.timings.ttft_s, layer, None))

        with trio.fail_after(args.duration + 120):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(scale)
                for arrival in trace:
                    nursery.start_soon(one, arrival)
        await client.shutdown()
    return samples, started_wall
