"""Command line of the benchmarks: `python -m engine.bench NAME [--json] [options]`."""

from __future__ import annotations

import argparse
import importlib
import sys

import msgspec

from engine.bench.rows import Row
from engine.logging import configure_diagnostics

BENCHMARKS = {
    "transfer": "engine.bench.transfer",
    "model": "engine.bench.model",
    "e2e": "engine.bench.e2e",
    "epd": "engine.bench.epd",
    "zigzag": "engine.bench.zigzag",
    "trace": "engine.bench.trace",
    "chaos": "engine.bench.chaos",
    "prefix": "engine.bench.trace.prefix",
    "compare": "engine.bench.compare",
}


def _format_table_row(row: Row) -> str:
    baseline = "-" if row.baseline is None else f"{row.baseline:.4g}"
    ratio = "-" if row.ratio is None else f"{row.ratio:.3f}"
    unit = f" {row.unit}" if row.unit else ""
    return (
        f"{row.case:<32} {row.metric:<28} {row.project:>12.4g}{unit}  "
        f"baseline {baseline:>10} ({row.baseline_name or '-'})  ratio {ratio} ({row.better} is better)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.bench", description=__doc__)
    sub = parser.add_subparsers(dest="name", required=True, metavar="NAME")
    modules = {}
    for name, module_name in BENCHMARKS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        modules[name] = module
        bench_parser = sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        bench_parser.add_argument("--json", action="store_true", help="one JSON object per row")
        module.add_arguments(bench_parser)
    args = parser.parse_args(argv)
    configure_diagnostics("warning")
    encoder = msgspec.json.Encoder()
    for result in modules[args.name].run(args):
        if args.json:
            sys.stdout.write(encoder.encode(result).decode() + "\n")
        else:
            sys.stdout.write(_format_table_row(result) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
