"""Plain-text rendering of the reports: aligned columns, human units, one blank line between tables.

Pure functions from report structs to strings; ``--json`` bypasses this module.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

from engine.logs.records import replica_order
from engine.logs.request import RequestReport
from engine.logs.summary import FlowRow, Summary
from engine.logs.timeline import Timeline

Cell = str | int | float | None


def seconds(value: float | None) -> str:
    """A duration in the unit that keeps 3 significant digits readable: µs, ms or s."""
    if value is None:
        return "-"
    magnitude = abs(value)
    if magnitude < 1e-3:
        return f"{value * 1e6:.1f} µs"
    if magnitude < 1.0:
        return f"{value * 1e3:.2f} ms"
    return f"{value:.3f} s"


def size(count: int) -> str:
    """Bytes in binary units (B, KiB, MiB, GiB)."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{count} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _numeric(cell: str) -> bool:
    return cell[:1].isdigit() or cell in ("-", ".") or (cell[:1] == "-" and cell[1:2].isdigit())


def table(headers: Sequence[str], rows: Sequence[Sequence[Cell]], *, title: str | None = None) -> str:
    """Columns padded to their widest cell: numbers (with or without units) right-aligned, text left."""
    text_rows = [[("-" if cell is None else str(cell)) for cell in row] for row in rows]
    widths = [max([len(header)] + [len(row[i]) for row in text_rows]) for i, header in enumerate(headers)]
    right = [bool(text_rows) and all(_numeric(row[i]) for row in text_rows) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.rjust(width) if is_right else cell.ljust(width)
            for cell, width, is_right in zip(cells, widths, right)
        ]
        return "  ".join(parts).rstrip()

    out = [title] if title else []
    out.append(line(headers))
    out.append("  ".join("-" * width for width in widths))
    out.extend(line(row) for row in text_rows)
    return "\n".join(out)


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(ts, tz=datetime.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def flow_matrix(flows: Sequence[FlowRow], *, title: str) -> str:
    """Bytes from each source (rows) to each destination (columns), all kinds together."""
    sources = sorted({flow.source for flow in flows}, key=replica_order)
    destinations = sorted({flow.destination for flow in flows}, key=replica_order)
    cells: dict[tuple[str, str], int] = {}
    for flow in flows:
        cells[(flow.source, flow.destination)] = cells.get((flow.source, flow.destination), 0) + flow.bytes
    rows = [
        [source, *(size(cells[(source, d)]) if (source, d) in cells else "." for d in destinations)]
        for source in sources
    ]
    return table(["source \\ destination", *destinations], rows, title=title)


def render_summary(summary: Summary) -> str:
    blocks = []
    logs = ", ".join(f"{log.path} ({log.events} events)" for log in summary.logs)
    blocks.append(f"logs: {logs}\nfrom {_when(summary.start_ts)}, span {seconds(summary.span_s)}")
    if summary.warnings:
        blocks.append("\n".join(f"warning: {warning}" for warning in summary.warnings))
    r = summary.requests
    cancel = ", ".join(f"{reason} {count}" for reason, count in r.cancel_reasons.items())
    blocks.append(
        f"requests: {r.arrived} arrived ({r.seen} seen); finished {r.finished_stop} stop, {r.finished_length} "
        f"length; {r.cancelled} cancelled{f' ({cancel})' if cancel else ''}; {r.failed} failed; "
        f"{r.queued} queued and {r.running} running when the log ends\n"
        f"tokens: {r.prompt_tokens} prompt, {r.generated_tokens} generated"
    )
    if summary.latency:
        blocks.append(
            table(
                ["phase", "n", "mean", "p50", "p90", "p99", "max"],
                [
                    [
                        row.phase,
                        row.count,
                        *(seconds(v) for v in (row.mean, row.p50, row.p90, row.p99, row.max)),
                    ]
                    for row in summary.latency
                ],
                title="latency (requests that finished with stop or length)",
            )
        )
    if summary.transfers or summary.unfinished_transfers:
        rows: list[list[Cell]] = [
            [
                row.kind,
                row.transport,
                row.count,
                row.succeeded,
                row.failed,
                " ".join(f"{rounds}:{count}" for rounds, count in row.rounds.items()),
                size(row.bytes),
                seconds(row.seconds),
                "-" if row.gb_per_s is None else f"{row.gb_per_s:.3f}",
            ]
            for row in summary.transfers
        ]
        text = table(
            ["kind", "transport", "count", "ok", "failed", "rounds:transfers", "bytes", "time", "GB/s"],
            rows,
            title="transfers (finished; rounds that carried data)",
        )
        if summary.unfinished_transfers:
            text += f"\n{summary.unfinished_transfers} transfer(s) started but never finished in the log"
        for reason, count in summary.transfer_failures.items():
            text += f"\nfailed {count}x: {reason}"
        blocks.append(text)
    if summary.states:
        blocks.append(
            table(
                ["replica", "state", "time", "share", "entered"],
                [
                    [s.replica, s.state, seconds(s.seconds), f"{s.share:.1%}", s.entered]
                    for s in summary.states
                ],
                title="time per replica state",
            )
        )
    if summary.locks:
        blocks.append(
            table(
                ["replica", "periods", "locked", "reasons"],
                [
                    [lock.replica, lock.periods, seconds(lock.seconds), ",".join(lock.reasons)]
                    for lock in summary.locks
                ],
                title="lock periods (accepting no new KV migrations)",
            )
        )
    if summary.prefix:
        blocks.append(
            table(
                ["replica", "prompts", "tokens", "hit tokens", "hit rate", "cached blocks", "evicted"],
                [
                    [
                        row.replica,
                        row.prompts,
                        row.prompt_tokens,
                        row.hit_tokens,
                        f"{row.hit_rate:.1%}",
                        "-" if row.cached_blocks is None else row.cached_blocks,
                        row.evicted_blocks,
                    ]
                    for row in summary.prefix
                ],
                title="prefix cache (prompts that started prefill; blocks as last reported)",
            )
        )
    if summary.flows:
        blocks.append(flow_matrix(summary.flows, title="network flow (bytes, from transfer rounds)"))
    if summary.reported_flows:
        blocks.append(
            flow_matrix(summary.reported_flows, title="network flow (bytes, from the controller's reports)")
        )
    if summary.errors:
        blocks.append(
            table(
                ["code", "count", "example"],
                [[e.code, e.count, e.example] for e in summary.errors],
                title="errors by code",
            )
        )
    if summary.problems:
        blocks.append("problems\n" + "\n".join(f"- {problem}" for problem in summary.problems))
    return "\n\n".join(blocks) + "\n"


def _fields(fields: dict[str, object]) -> str:
    return " ".join(
        f"{key}={value:.6g}" if isinstance(value, float) else f"{key}={value}"
        for key, value in fields.items()
        if value is not None
    )


def render_request(report: RequestReport) -> str:
    rows = [
        [
            seconds(row.at),
            seconds(row.since_previous),
            seconds(row.took),
            row.event,
            row.replica,
            _fields(row.fields),
        ]
        for row in report.events
    ]
    head = (
        f"request {report.request_id}: {len(report.events)} events from {_when(report.start_ts)}, "
        f"outcome {report.outcome or 'unknown (the log ends first)'}"
    )
    events = table(["at", "+prev", "took", "event", "replica", "fields"], rows)
    timings = report.timings
    breakdown = table(
        ["phase", "seconds"],
        [[name.removesuffix("_s"), seconds(getattr(timings, name))] for name in timings.__struct_fields__],
        title="latency breakdown",
    )
    return f"{head}\n\n{events}\n\n{breakdown}\n"


def render_timeline(timeline: Timeline) -> str:
    """A text digest of the timeline (what the picture shows), for the terminal."""
    rows: list[list[Cell]] = [
        [
            lane.replica,
            " → ".join(segment.state for segment in lane.segments),
            len(lane.locks),
            len(lane.failures),
        ]
        for lane in timeline.lanes
    ]
    text = table(["replica", "states", "locks", "failures"], rows)
    return f"{text}\n{len(timeline.requests)} request spans over {seconds(timeline.end)}\n"
