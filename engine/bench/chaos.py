"""chaos: a cluster of hosts under load through a seeded schedule of faults; what the clients saw.

`python -m engine.bench chaos --seconds N` runs `engine.chaos.run.run_chaos`: four nodes, each in its own
network namespace (prefill on hosts a and b, decode on c and d, etcd on a fifth; `engine.hosts`), the tiny
model, `--transport tcp --lease-ttl T --emulated-speed decode_steps_per_s=S`, `--clients` clients
sending greedy requests (10–300 prompt tokens, 10–60 new) to random running nodes for N seconds while,
every `--period` seconds, one fault happens: a host's link cut for `--partition` seconds, a node killed
with SIGKILL and started again (same --node-id) once its lease ended, etcd killed and restarted, or the
leader killed and started again — drawn by `--seed` (or exactly `--kinds`, in the order the seed shuffles
them). Needs root and iproute2 (namespaces); elsewhere it stops, saying why.

Rows (no baseline: the figures are counts): requests, results, results whose tokens differ from the model
run in one piece (`--no-check` skips the check), errors by code, unreachable nodes, connections lost,
requests that never ended, seconds from the end of the last fault until every node served a request
again, and blocks still held once the load stopped. The note names the seed and the schedule.
`--logs DIR` keeps the nodes' logs (a temporary folder, removed, otherwise).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Final, Literal, cast

import torch
import trio

from engine.bench.rows import Row, row
from engine.chaos.run import ChaosConfig, ChaosReport, check_tokens, run_chaos
from engine.chaos.schedule import KINDS, FaultKind
from engine.hosts.network import unavailable
from replicas.model import tiny_model

BENCH: Final = "chaos"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=120.0, help="seconds of load (default 120)")
    parser.add_argument("--seed", type=int, default=46, help="the schedule's and the clients' seed (46)")
    parser.add_argument("--clients", type=int, default=6, help="concurrent clients (default 6)")
    parser.add_argument("--period", type=float, default=12.0, help="seconds between faults (default 12)")
    parser.add_argument("--partition", type=float, default=6.0, help="seconds a link stays cut (default 6)")
    parser.add_argument("--lease-ttl", type=int, default=3, help="the nodes' --lease-ttl (default 3)")
    parser.add_argument("--decode-steps-per-s", type=int, default=40, help="emulated decode speed (40)")
    parser.add_argument(
        "--kinds", default=None, help=f"comma-separated faults, in the seed's order ({', '.join(KINDS)})"
    )
    parser.add_argument("--no-check", action="store_true", help="skip checking the results' tokens")
    parser.add_argument("--logs", type=Path, default=None, help="keep the nodes' logs in this folder")


def run(args: argparse.Namespace) -> Iterable[Row]:
    reason = unavailable()
    if reason is not None:
        raise SystemExit(f"engine.bench chaos needs hosts in network namespaces: {reason}")
    kinds = None
    if args.kinds:
        kinds = tuple(cast(FaultKind, kind.strip()) for kind in args.kinds.split(","))
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise SystemExit(f"--kinds: unknown faults {sorted(unknown)} (faults: {', '.join(KINDS)})")
    config = ChaosConfig(
        seed=args.seed,
        seconds=args.seconds,
        period_s=args.period,
        partition_s=args.partition,
        lease_ttl=args.lease_ttl,
        clients=args.clients,
        kinds=kinds,
        decode_steps_per_s=args.decode_steps_per_s,
    )
    directory = Path(tempfile.mkdtemp(prefix="zigzag-chaos-")) if args.logs is None else args.logs
    directory.mkdir(parents=True, exist_ok=True)
    try:
        report = trio.run(run_chaos, directory, config)
        mismatches = None
        if not args.no_check:
            torch.set_num_threads(1)  # one sequence at a time: one thread is as fast, and shares the CPU
            mismatches = len(check_tokens(tiny_model(), report.records))
        for line in report.summary():  # the same counts in sentences, beside the rows on stdout
            print(f"chaos: {line}", file=sys.stderr)
        yield from rows(report, mismatches)
    finally:
        if args.logs is None:
            shutil.rmtree(directory, ignore_errors=True)


def rows(report: ChaosReport, mismatches: int | None) -> list[Row]:
    config = report.config
    case = f"4hosts-{config.seconds:g}s-seed{config.seed}"
    note = (
        f"seed {config.seed}, {config.clients} clients, ttl {config.lease_ttl} s, faults every "
        f"{config.period_s:g} s: "
        + "; ".join(f"{f.started_s:.0f}s {f.fault.kind} {f.target}" for f in report.faults)
    )
    outcomes = report.outcomes()
    better_lower: Literal["lower"] = "lower"

    def count(
        metric: str, value: float, better: Literal["higher", "lower"] = better_lower, unit: str = ""
    ) -> Row:
        return row(BENCH, case, metric, better, value, unit=unit or None, note=note)

    table = [
        count("requests", len(report.records), "higher"),
        count("results", outcomes["result"], "higher"),
    ]
    if mismatches is not None:
        table.append(count("results_not_the_models_tokens", mismatches))
    table += [count(f"errors_{code}", n) for code, n in sorted(report.error_codes().items())]
    table += [
        count("unreachable", outcomes["unreachable"]),
        count("connection_lost", outcomes["connection_lost"]),
        count("no_end", outcomes["no_end"]),
    ]
    serve = report.time_to_serve_s
    table.append(count("time_to_serve_again_s", float("inf") if serve is None else serve, unit="s"))
    table.append(count("blocks_held", sum(report.blocks_held.values())))
    table.append(count("nodes_not_serving_after", sum(v != "ok" for v in report.serves_after.values())))
    return table
