"""compare: one benchmark on this tree and on another revision, alternately in one run, figure by figure.

`python -m engine.bench compare REV [--rounds N] NAME [BENCH ARGS...]` exports REV (`git archive`, into a
temporary directory), then runs `python -m engine.bench NAME --json BENCH ARGS` N times on each tree,
alternating which goes first (this tree, REV; REV, this tree; …) so that a machine that warms up or
slows down during the run moves both sides alike. Each tree's run is its own process, its packages
first on `PYTHONPATH` (the nodes a benchmark starts inherit it), with this virtualenv's Python and
dependencies: what differs is the code. A `--logs DIR` among the benchmark's arguments becomes
`DIR/<tree>-<round>` per run.

Every figure a benchmark row carries — its project value, and its baseline's where it has one (a
baseline measured in the same run, such as `trace`'s static way or `model`'s HF) — becomes a row here:
`project` is this tree's median over the rounds, `baseline` REV's, `ratio` this tree / REV, with the
benchmark row's own `better`. The note says whether the difference is beyond the noise the rounds
show: "worse" or "better" when every round of one side beats every round of the other (the two
ranges do not overlap), "within noise" otherwise; with one round there is no noise to judge by.

Why: a ratio measured within one run (the project against its baseline) cannot see a change that moves
both sides — a slower node slows the benchmark's own reference too. Comparing the same figure on two
trees catches a regression between commits as a number.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal, final

import msgspec

from engine.bench.compare.trees import RevisionError, Tree, current, exported
from engine.bench.rows import Row, row

BENCH: Final = "compare"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rev", help="the revision to compare this tree with (a commit, tag or branch)")
    parser.add_argument(
        "--rounds", type=int, default=2, help="runs of the benchmark on each tree, alternating (default 2)"
    )
    parser.add_argument("bench", help="the benchmark to run on both trees (transfer, model, e2e, trace, …)")
    parser.add_argument(
        "bench_args",
        nargs=argparse.REMAINDER,
        help="its arguments, as `python -m engine.bench NAME` takes them",
    )


@final
@dataclass(slots=True)
class Figure:
    """One figure of the benchmark's rows, as each tree measured it, round by round."""

    case: str
    metric: str
    better: Literal["higher", "lower"]
    unit: str | None
    values: dict[str, list[float]] = field(default_factory=dict)  # tree label → one value per round


def run(args: argparse.Namespace) -> Iterable[Row]:
    if args.rounds < 1:
        raise SystemExit("compare: --rounds must be at least 1")
    if args.bench == BENCH:
        raise SystemExit("compare: the benchmark to compare cannot be compare itself")
    try:
        with exported(args.rev) as other:
            figures = measure([current(), other], args.bench, list(args.bench_args), args.rounds)
            yield from compared(figures, current(), other, args.bench, args.rounds)
    except RevisionError as exc:
        raise SystemExit(f"compare: {exc}") from exc


def measure(
    trees: list[Tree], bench: str, bench_args: list[str], rounds: int
) -> dict[tuple[str, str], Figure]:
    """Run `bench` `rounds` times on each tree, alternating the order; the figures of their rows."""
    figures: dict[tuple[str, str], Figure] = {}
    for round_ in range(rounds):
        order = trees if round_ % 2 == 0 else list(reversed(trees))
        for tree in order:
            for bench_row in run_once(tree, bench, bench_args, round_):
                for key, value in _values(bench_row):
                    figure = figures.setdefault(key, Figure(key[0], key[1], bench_row.better, bench_row.unit))
                    figure.values.setdefault(tree.label, []).append(value)
    return figures


def run_once(tree: Tree, bench: str, bench_args: list[str], round_: int) -> list[Row]:
    """One run of the benchmark on `tree`: its rows (its other output goes to this process's stderr)."""
    argv = [sys.executable, "-m", "engine.bench", bench, "--json", *_per_run(bench_args, tree, round_)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tree.path), os.environ.get("PYTHONPATH")])),
    }
    print(f"compare: round {round_ + 1}, {tree.label}: {shlex.join(argv[1:])}", file=sys.stderr, flush=True)
    done = subprocess.run(argv, cwd=tree.path, env=env, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"compare: the benchmark failed on {tree.label} (exit {done.returncode})")
    decoder = msgspec.json.Decoder(Row)
    return [decoder.decode(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _per_run(bench_args: list[str], tree: Tree, round_: int) -> list[str]:
    """`bench_args` with a `--logs DIR` made `DIR/<tree>-<round>` (each run keeps its own logs)."""
    out = list(bench_args)
    for index, arg in enumerate(out):
        if arg == "--logs" and index + 1 < len(out):
            out[index + 1] = str(Path(out[index + 1]) / f"{_slug(tree.label)}-{round_ + 1}")
        elif arg.startswith("--logs="):
            out[index] = "--logs=" + str(
                Path(arg.removeprefix("--logs=")) / f"{_slug(tree.label)}-{round_ + 1}"
            )
    return out


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in label)


def _values(bench_row: Row) -> Iterator[tuple[tuple[str, str], float]]:
    """The figures of one row: its project value, and its baseline's (named) where it has one."""
    yield (bench_row.case, bench_row.metric), bench_row.project
    if bench_row.baseline is not None:
        yield (
            (bench_row.case, f"{bench_row.metric} [{bench_row.baseline_name or 'baseline'}]"),
            bench_row.baseline,
        )


def verdict(better: Literal["higher", "lower"], ours: list[float], theirs: list[float]) -> str:
    """ "worse", "better" or "within noise" (see the module docstring); "one round" with one value each."""
    if len(ours) < 2 or len(theirs) < 2:
        return "one round: no noise estimate"
    higher = min(ours) > max(theirs)
    lower = max(ours) < min(theirs)
    if not (higher or lower):
        return "within noise"
    return "better" if higher == (better == "higher") else "worse"


def compared(
    figures: dict[tuple[str, str], Figure], ours: Tree, theirs: Tree, bench: str, rounds: int
) -> Iterator[Row]:
    """A row per figure both trees measured (medians, this tree over the other); figures only one tree
    has are named on stderr."""
    for figure in figures.values():
        mine, other = figure.values.get(ours.label), figure.values.get(theirs.label)
        if not mine or not other:
            side = ours.label if mine else theirs.label
            print(f"compare: {figure.case} {figure.metric}: only {side} measures it", file=sys.stderr)
            continue
        spread = f"{_range(mine)} against {_range(other)} over {rounds} round(s)"
        yield row(
            f"{BENCH}:{bench}",
            figure.case,
            figure.metric,
            figure.better,
            statistics.median(mine),
            statistics.median(other),
            theirs.label,
            unit=figure.unit,
            note=f"{verdict(figure.better, mine, other)}; {spread}",
        )


def _range(values: list[float]) -> str:
    return f"{min(values):.4g}–{max(values):.4g}" if len(values) > 1 else f"{values[0]:.4g}"
