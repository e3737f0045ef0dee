"""The `trace` benchmark's workload: a production trace (the default), a seeded generator, or a CSV file.

`--trace azure-conv` (the default): the Azure LLM inference trace 2023's conversation CSV, vendored in
engine/bench/trace/data/ with its attribution and citation (CC BY 4.0), read as a CSV trace below with
its own columns; unless given, `--trace-offset` 1920, `--duration` 240, `--time-scale` 0.5 and
`--length-scale` 0.25 (a 4-minute window of the hour, replayed in 2 minutes — twice the request rate —
with prompts and outputs a quarter as long: half the prompt tokens per second of the original, which a
few CPU cores compute for real under the emulation's padding).

`--trace synthetic`: Gamma-distributed inter-arrival times at `--rate` requests/s, their coefficient of
variation `--cv` (shape 1 / cv²; `--gamma-shape` sets the shape itself; cv 1 is Poisson), the rate
multiplied by `--burst-factor` from `--burst-at` for `--burst-len` seconds, over `--duration` seconds. The
arrivals are a unit-rate Gamma renewal process mapped through the cumulative rate (so the burst changes
the rate, not the shape). Prompt and output lengths are log-normal around `--prompt-mean` and
`--output-mean` (σ `--length-sigma` of the logarithm), clipped to `[--prompt-min, --prompt-max]` and
`[1, --output-max]`. One `--seed` gives one trace; `--duration` 60 unless given.

CSV (`--trace-csv FILE`, in place of `--trace`): one request per row; `--columns arrival=COL,prompt=COL,output=COL` names the
columns (the default fits Azure's LLM inference traces; BurstGPT:
`arrival=Timestamp,prompt=Request tokens,output=Response tokens`). Arrivals are seconds (relative or
absolute) or ISO-8601 date-times; they are taken relative to the earliest and sorted; the requests
arriving in the window `[--trace-offset, --trace-offset + --duration)` seconds of the trace's own time
are kept, shifted to start at 0 and multiplied by `--time-scale` (0.5 replays the window twice as fast).
Prompt and output lengths are multiplied by `--length-scale` (rounded, at least 1), then clipped as above
(an output of 0, a failed request in BurstGPT, becomes 1). A CSV file's defaults: `--duration` 60,
`--time-scale` and `--length-scale` 1.

`--save-trace FILE` also writes the requests a run replays to a CSV of Azure's columns: `--trace-csv FILE`
replays exactly them — on another tree too, whose options may differ (`engine.bench compare`).
"""

from __future__ import annotations

import argparse
import bisect
import csv
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Final, final

ROLES: Final = ("arrival", "prompt", "output")
AZURE_COLUMNS: Final = "arrival=TIMESTAMP,prompt=ContextTokens,output=GeneratedTokens"
DATA: Final = Path(__file__).resolve().parent / "data"
AZURE_CONV: Final = DATA / "AzureLLMInferenceTrace_conv.csv"
TRACES: Final = ("azure-conv", "synthetic")


@final
@dataclass(frozen=True, slots=True)
class Window:
    """Which part of a CSV trace is replayed, and how it is scaled (the module docstring)."""

    offset: float = 0.0
    duration: float = math.inf
    time_scale: float = 1.0
    length_scale: float = 1.0


# The defaults of each source: (offset, duration, time scale, length scale).
PRESETS: Final = {
    "azure-conv": Window(1920.0, 240.0, 0.5, 0.25),
    "synthetic": Window(0.0, 60.0, 1.0, 1.0),
    "csv": Window(0.0, 60.0, 1.0, 1.0),
}


@final
@dataclass(frozen=True, slots=True)
class TraceRequest:
    at: float  # seconds from the trace's start
    prompt_tokens: int
    output_tokens: int


@final
@dataclass(frozen=True, slots=True)
class Lengths:
    """How request lengths are drawn (generated traces) and clipped (every trace)."""

    prompt_mean: float = 384.0
    prompt_min: int = 16
    prompt_max: int = 2048
    output_mean: float = 24.0
    output_max: int = 128
    sigma: float = 0.8

    def clip_prompt(self, tokens: int) -> int:
        return min(max(tokens, self.prompt_min, 1), self.prompt_max)

    def clip_output(self, tokens: int) -> int:
        return min(max(tokens, 1), self.output_max)


@final
@dataclass(frozen=True, slots=True)
class Shape:
    """A generated trace's arrivals: see the module docstring."""

    rate: float
    duration: float
    gamma_shape: float
    burst_factor: float = 1.0
    burst_at: float = 0.0
    burst_len: float = 0.0

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.duration <= 0 or self.gamma_shape <= 0 or self.burst_factor <= 0:
            raise ValueError("rate, duration, gamma shape and burst factor must be positive")
        if self.burst_at < 0 or self.burst_len < 0:
            raise ValueError("the burst's start and length must not be negative")

    def cumulative(self, t: float) -> float:
        """Expected arrivals in [0, t): the integral of the rate."""
        inside = min(max(t - self.burst_at, 0.0), self.burst_len)
        return self.rate * (t + (self.burst_factor - 1.0) * inside)

    def time_of(self, arrivals: float) -> float:
        """The inverse of `cumulative`."""
        before = self.rate * self.burst_at
        if arrivals <= before:
            return arrivals / self.rate
        during = self.rate * self.burst_factor * self.burst_len
        if arrivals <= before + during:
            return self.burst_at + (arrivals - before) / (self.rate * self.burst_factor)
        return self.burst_at + self.burst_len + (arrivals - before - during) / self.rate


def gamma_shape(cv: float) -> float:
    """The Gamma shape whose inter-arrival times have coefficient of variation `cv`."""
    if cv <= 0:
        raise ValueError(f"--cv must be positive, got {cv}")
    return 1.0 / (cv * cv)


def generate(shape: Shape, lengths: Lengths, seed: int) -> list[TraceRequest]:
    """The seeded trace (module docstring)."""
    rng = random.Random(seed)
    k = shape.gamma_shape
    mu_prompt = math.log(lengths.prompt_mean) - lengths.sigma**2 / 2
    mu_output = math.log(lengths.output_mean) - lengths.sigma**2 / 2
    trace: list[TraceRequest] = []
    clock = 0.0  # in expected arrivals (unit rate)
    total = shape.cumulative(shape.duration)
    while True:
        clock += rng.gammavariate(k, 1.0 / k)
        if clock >= total:
            return trace
        prompt = lengths.clip_prompt(round(rng.lognormvariate(mu_prompt, lengths.sigma)))
        output = lengths.clip_output(round(rng.lognormvariate(mu_output, lengths.sigma)))
        trace.append(TraceRequest(shape.time_of(clock), prompt, output))


# ---------------------------------------------------------------------------------------------- CSV
def parse_columns(text: str) -> dict[str, str]:
    """`arrival=COL,prompt=COL,output=COL` → {role: column}; ValueError naming what is wrong."""
    mapping: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        role, sep, column = part.partition("=")
        role, column = role.strip(), column.strip()
        if not sep or role not in ROLES or not column:
            raise ValueError(f"--columns: {part!r} is not ROLE=COLUMN with ROLE one of {', '.join(ROLES)}")
        mapping[role] = column
    missing = [role for role in ROLES if role not in mapping]
    if missing:
        raise ValueError(f"--columns: no column for {', '.join(missing)}")
    return mapping


def _seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    moment = datetime.fromisoformat(text.strip())  # ValueError names the text
    return moment.timestamp()


def read_csv(
    path: Path,
    columns: dict[str, str],
    lengths: Lengths,
    *,
    time_scale: float = 1.0,
    offset: float = 0.0,
    duration: float = math.inf,
    length_scale: float = 1.0,
) -> list[TraceRequest]:
    """The CSV trace at `path` (module docstring); ValueError naming the file and line of a bad row."""
    if time_scale <= 0 or length_scale <= 0:
        raise ValueError(
            f"--time-scale and --length-scale must be positive, got {time_scale}, {length_scale}"
        )
    rows: list[tuple[float, int, int]] = []
    with path.open(newline="", encoding="utf-8-sig") as handle:
        reader = csv.DictReader(handle)
        absent = [c for c in columns.values() if c not in (reader.fieldnames or [])]
        if absent:
            raise ValueError(f"{path}: no column {', '.join(map(repr, absent))} (has {reader.fieldnames})")
        for line, record in enumerate(reader, start=2):
            try:
                at = _seconds(record[columns["arrival"]])
                prompt = int(float(record[columns["prompt"]]))
                output = int(float(record[columns["output"]]))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{line}: {exc}") from None
            rows.append((at, prompt, output))
    if not rows:
        return []
    first = min(at for at, _, _ in rows)

    def scaled(tokens: int) -> int:
        return max(1, round(tokens * length_scale)) if tokens > 0 else tokens

    return [
        TraceRequest(
            (at - first - offset) * time_scale,
            lengths.clip_prompt(scaled(p)),
            lengths.clip_output(scaled(o)),
        )
        for at, p, o in sorted(rows, key=lambda r: r[0])
        if 0.0 <= at - first - offset < duration
    ]


# ---------------------------------------------------------------------------------------------- windows
def peak_window(trace: Sequence[TraceRequest], seconds: float) -> tuple[float, float]:
    """(start, end) of the `seconds`-long window holding the most prompt tokens (it starts at an arrival)."""
    starts = [r.at for r in trace]
    sums = [0]
    for r in trace:
        sums.append(sums[-1] + r.prompt_tokens)
    best, best_start = -1, 0.0
    for index, start in enumerate(starts):
        stop = bisect.bisect_left(starts, start + seconds)
        tokens = sums[stop] - sums[index]
        if tokens > best:
            best, best_start = tokens, start
    return best_start, best_start + seconds


def window(trace: Sequence[TraceRequest], start: float, end: float) -> list[TraceRequest]:
    """The requests arriving in [start, end), shifted to start at 0."""
    return [
        TraceRequest(r.at - start, r.prompt_tokens, r.output_tokens) for r in trace if start <= r.at < end
    ]


def prompt_tokens_per_s(trace: Sequence[TraceRequest], seconds: float) -> float:
    return sum(r.prompt_tokens for r in trace) / seconds if seconds > 0 else 0.0


# ---------------------------------------------------------------------------------------------- options
def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("the trace")
    group.add_argument(
        "--trace",
        choices=TRACES,
        default="azure-conv",
        help="azure-conv (default: the vendored Azure LLM inference trace 2023, conversations) or synthetic",
    )
    group.add_argument("--seed", type=int, default=7)
    group.add_argument("--rate", type=float, default=6.0, help="requests/s outside the burst (default 6)")
    group.add_argument(
        "--duration", type=float, default=None, help="seconds of trace (azure-conv 240, else 60)"
    )
    group.add_argument("--cv", type=float, default=2.0, help="inter-arrival coefficient of variation (2)")
    group.add_argument("--gamma-shape", type=float, default=None, help="the Gamma shape (default 1/cv²)")
    group.add_argument("--burst-factor", type=float, default=4.0, help="the rate's factor in the burst (4)")
    group.add_argument("--burst-at", type=float, default=25.0, help="the burst's start, s (default 25)")
    group.add_argument("--burst-len", type=float, default=10.0, help="the burst's length, s (default 10)")
    group.add_argument("--prompt-mean", type=float, default=384.0, help="prompt tokens, mean (384)")
    group.add_argument("--prompt-min", type=int, default=16)
    group.add_argument("--prompt-max", type=int, default=2048)
    group.add_argument("--output-mean", type=float, default=24.0, help="output tokens, mean (24)")
    group.add_argument("--output-max", type=int, default=128)
    group.add_argument("--length-sigma", type=float, default=0.8, help="σ of the lengths' logarithm")
    group.add_argument("--trace-csv", type=Path, default=None, help="replay this CSV trace instead")
    group.add_argument("--columns", default=AZURE_COLUMNS, help=f"CSV columns (default {AZURE_COLUMNS})")
    group.add_argument(
        "--time-scale", type=float, default=None, help="CSV arrival gaps × this (azure-conv 0.5, else 1)"
    )
    group.add_argument(
        "--length-scale",
        type=float,
        default=None,
        help="CSV prompt and output lengths × this (azure-conv 0.25, else 1)",
    )
    group.add_argument(
        "--trace-offset",
        type=float,
        default=None,
        help="CSV: the window's start, s of the trace (azure-conv 1920)",
    )
    group.add_argument(
        "--save-trace",
        type=Path,
        default=None,
        help="also write the replayed requests to this CSV (Azure's columns), to replay them elsewhere",
    )


def write_csv(trace: Sequence[TraceRequest], path: Path) -> None:
    """`trace` as a CSV with Azure's columns (`AZURE_COLUMNS`): read back with `--trace-csv` (its
    defaults: no offset, time and lengths × 1) it is the same requests."""
    with path.open("w", encoding="utf-8", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        for request in trace:
            writer.writerow([f"{request.at:.6f}", request.prompt_tokens, request.output_tokens])


def lengths_from(args: argparse.Namespace) -> Lengths:
    return Lengths(
        prompt_mean=args.prompt_mean,
        prompt_min=args.prompt_min,
        prompt_max=args.prompt_max,
        output_mean=args.output_mean,
        output_max=args.output_max,
        sigma=args.length_sigma,
    )


def source(args: argparse.Namespace) -> str:
    """`csv`, `azure-conv` or `synthetic`: what the options replay."""
    return "csv" if args.trace_csv is not None else str(args.trace)


def window_from(args: argparse.Namespace) -> Window:
    """The options' window, each unset one at its source's default (`PRESETS`); sets them on `args`."""
    preset = PRESETS[source(args)]
    chosen = Window(
        offset=preset.offset if args.trace_offset is None else args.trace_offset,
        duration=preset.duration if args.duration is None else args.duration,
        time_scale=preset.time_scale if args.time_scale is None else args.time_scale,
        length_scale=preset.length_scale if args.length_scale is None else args.length_scale,
    )
    args.trace_offset, args.duration = chosen.offset, chosen.duration
    args.time_scale, args.length_scale = chosen.time_scale, chosen.length_scale
    return chosen


def trace_from(args: argparse.Namespace) -> list[TraceRequest]:
    """The trace the options describe (ValueError on bad options or a bad CSV)."""
    lengths = lengths_from(args)
    chosen = window_from(args)
    if source(args) != "synthetic":
        path, columns = (
            (args.trace_csv, args.columns) if args.trace_csv is not None else (AZURE_CONV, AZURE_COLUMNS)
        )
        return read_csv(
            path,
            parse_columns(columns),
            lengths,
            time_scale=chosen.time_scale,
            offset=chosen.offset,
            duration=chosen.duration,
            length_scale=chosen.length_scale,
        )
    shape = Shape(
        rate=args.rate,
        duration=args.duration,
        gamma_shape=args.gamma_shape if args.gamma_shape is not None else gamma_shape(args.cv),
        burst_factor=args.burst_factor,
        burst_at=args.burst_at,
        burst_len=args.burst_len,
    )
    return generate(shape, lengths, args.seed)
