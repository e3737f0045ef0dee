"""The `trace` benchmark's picture: TTFT over time and the replica count over time, one series per way.

Top: each request's TTFT at its arrival (failed requests as crosses at the top edge), the SLO's floor as a
dashed line. Bottom: the replicas not `Inactive` (prefill and decode), as polled from `status`. The burst of
a generated trace is shaded in both. Needs matplotlib (the extra `plot`); draws on a `Figure` (no pyplot)
and writes the format the suffix names. The caption names the CPU and the command (less `--logs`).
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping
from pathlib import Path

from engine.bench.trace.replay import Run
from engine.bench.trace.slo import Slo
from engine.bench.zigzag_plot import COLOURS, MARKERS, _without_logs, cpu_name


def draw(
    runs: Mapping[str, Run],
    path: Path,
    slo: Slo,
    *,
    burst: tuple[float, float] | None = None,
    subtitle: str = "",
) -> None:
    """Draw the runs (label → run) into `path`."""
    import matplotlib
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10.0, 7.0), layout="constrained")
    ttft_axes, count_axes = figure.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    top = max((o.ttft for r in runs.values() for o in r.outcomes if o.ttft is not None), default=1.0)
    for index, (label, run) in enumerate(runs.items()):
        colour = COLOURS[index % len(COLOURS)]
        marker = MARKERS[(index + 1) % len(MARKERS)]
        served = [o for o in run.outcomes if o.ttft is not None]
        ttft_axes.plot([o.at for o in served], [o.ttft for o in served], marker=marker, linestyle="none",
                       markersize=3.2, color=colour, markerfacecolor="none", alpha=0.7, label=label)  # fmt: skip
        failed = [o.at for o in run.outcomes if o.ttft is None]
        if failed:
            ttft_axes.plot(failed, [top * 1.05] * len(failed), marker="x", linestyle="none", color=colour)
        span = max((o.end for o in run.outcomes), default=0.0)
        samples = [s for s in run.samples if 0.0 <= s.at <= span]
        count_axes.step([s.at for s in samples], [s.active for s in samples], where="post", color=colour,
                        linewidth=1.6, label=label)  # fmt: skip
    for axes in (ttft_axes, count_axes):
        if burst is not None:
            axes.axvspan(*burst, color="#888888", alpha=0.12, linewidth=0)
        axes.grid(True, alpha=0.3)
    ttft_axes.axhline(slo.floor, color="black", linestyle="--", linewidth=1.0)
    ttft_axes.annotate(f"SLO floor {slo.floor:g} s", (0.0, slo.floor), xytext=(4, 3), textcoords="offset points",
                       fontsize="small", xycoords=("axes fraction", "data"))  # fmt: skip
    ttft_axes.set_yscale("log")
    ttft_axes.set_ylabel("time to first token (s)")
    ttft_axes.legend(loc="upper left", fontsize="small")
    ttft_axes.set_title("A bursty trace: static provisioning against the planner (serverless, blitz)")
    count_axes.set_ylabel("replicas not Inactive")
    count_axes.set_xlabel("seconds from the trace's start" + (" (burst shaded)" if burst else ""))
    count_axes.set_ylim(bottom=0)
    count_axes.legend(loc="upper left", fontsize="small")
    command = "python -m engine.bench " + " ".join(shlex.quote(a) for a in _without_logs(sys.argv[1:]))
    caption = f"{cpu_name()}, {command}"
    if subtitle:
        caption += f"\n{subtitle}"
    figure.supxlabel(caption, fontsize="x-small", color="#555555")
    with matplotlib.rc_context({"svg.hashsalt": "zigzag-trace", "svg.fonttype": "none"}):
        figure.savefig(path, dpi=110, metadata={"Date": None} if path.suffix == ".svg" else None)
