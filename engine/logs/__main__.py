"""`python -m engine.logs COMMAND LOG...`: read the node's JSON-lines event logs (docs/logs.md).

Commands: ``summary`` (latency, transfer, state, flow and error tables), ``timeline`` (a picture: one lane
per replica coloured by state, lock periods, request spans beneath), ``request --id ID`` (one request's
events in order, with durations). ``--json`` prints the same data as one JSON object. Several logs merge by
time. Warnings (cut-off last lines, skipped lines) go to stderr.

Exit status: 0 done, 1 the logs cannot be read, hold no events, or the request is not there, 2 bad usage,
3 the picture needs matplotlib, which is not installed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Final

import msgspec

from engine.logs.aggregate import Aggregator
from engine.logs.reader import LogError, LogSet
from engine.logs.request import RequestNotFound, find_request, request_report
from engine.logs.summary import summarize
from engine.logs.tables import render_request, render_summary, render_timeline
from engine.logs.timeline import DEFAULT_MAX_ROWS, build_timeline

PROG: Final = "python -m engine.logs"
INSTALL_PLOT: Final = "pip install 'zigzag[plot]'"
PICTURE_SUFFIXES: Final = (".png", ".svg", ".pdf")  # matplotlib picks the format by the suffix


class _Failed(Exception):
    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=(__doc__ or "").split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("logs", nargs="+", metavar="LOG", help="JSON-lines event log(s) of node(s)")
        sub.add_argument("--json", action="store_true", help="print the data as one JSON object")
        sub.add_argument(
            "--label-logs",
            action="store_true",
            help="prefix replica names and request ids with each log's file name (independent nodes)",
        )
        return sub

    command("summary", "latency breakdown, transfers, time per replica state, network flow, errors")
    timeline = command("timeline", "a picture of replica states, locks and request spans over time")
    timeline.add_argument("-o", "--output", metavar="FILE.png", help="write the picture here")
    timeline.add_argument("--title", help="title of the picture")
    timeline.add_argument(
        "--max-rows", type=int, default=DEFAULT_MAX_ROWS, help="rows of request spans before they share rows"
    )
    request = command("request", "one request's events in order, with durations")
    request.add_argument(
        "--id", required=True, dest="request_id", help="request id, or a unique prefix of one"
    )
    return parser


def _emit_json(value: object) -> None:
    sys.stdout.write(msgspec.json.encode(value).decode() + "\n")


def _run(args: argparse.Namespace) -> None:
    logs = LogSet(args.logs, label_logs=args.label_logs)
    entries = list(logs.entries())
    warnings = logs.warnings()
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if not entries:
        raise _Failed(f"no events in {', '.join(args.logs)}")
    if args.command == "request":
        report = request_report(entries, find_request(entries, args.request_id))
        if args.json:
            _emit_json(report)
        else:
            sys.stdout.write(render_request(report))
        return
    aggregator = Aggregator()
    for entry in entries:
        aggregator.add(entry.event)
    if args.command == "summary":
        summary = summarize(aggregator, logs=logs.stats, warnings=warnings)
        if args.json:
            _emit_json(summary)
        else:
            sys.stdout.write(render_summary(summary))
        return
    if args.max_rows < 1:
        raise _Failed(f"--max-rows {args.max_rows}: must be at least 1", status=2)
    if args.output is None and not args.json:
        raise _Failed("timeline: give -o FILE.png for the picture, or --json for the data", status=2)
    if args.output is not None and not args.output.lower().endswith(PICTURE_SUFFIXES):
        raise _Failed(
            f"timeline: -o {args.output!r} must name a picture file ending in {', '.join(PICTURE_SUFFIXES)}",
            status=2,
        )
    timeline = build_timeline(aggregator, max_rows=args.max_rows)
    if args.output is not None:
        try:
            from engine.logs.plot import draw_timeline
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.partition(".")[0] != "matplotlib":
                raise
            raise _Failed(
                f"the timeline picture needs matplotlib, which is not installed: {INSTALL_PLOT} "
                "(or use --json for the data)",
                status=3,
            ) from exc
        try:
            draw_timeline(timeline, args.output, title=args.title)
        except OSError as exc:
            raise _Failed(f"cannot write {args.output!r}: {exc.strerror or exc}") from exc
    if args.json:
        _emit_json(timeline)
    else:
        sys.stdout.write(render_timeline(timeline))
        print(f"wrote {args.output}")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        _run(args)
    except (LogError, RequestNotFound) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    except _Failed as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return exc.status
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
