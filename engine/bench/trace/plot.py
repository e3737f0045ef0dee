"""The `trace` benchmark's picture: arrivals and forecasts over time, and the replicas of each way.

Top: the trace's prompt tokens per second (1-second bins, as replayed) and each predictor's forecast of
them — the `arriving_tokens_per_s` its planner logged with each prefill decision (`planner_decision`
events' `forecast`), at the time of the decision. Bottom: the replicas not `Inactive` (prefill and
decode; loading, serving, draining) of every way, as polled from `status`. Needs matplotlib (the extra
`plot`); draws on a `Figure` (no pyplot) and writes the format the suffix names. The caption names the
CPU and the command (less `--logs`).
"""

from __future__ import annotations

import math
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

from engine.bench.trace.gen import TraceRequest
from engine.bench.trace.replay import Run
from engine.bench.zigzag.plot import _without_logs, cpu_name

COLOURS: Final = ("#222222", "#d1495b", "#2f6db5", "#2e9e4f", "#7b4fa0", "#e08a1e", "#17becf", "#8c564b")
BIN_S: Final = 1.0


def arrivals(trace: Sequence[TraceRequest]) -> tuple[list[float], list[float]]:
    """(bin starts, prompt tokens/s) of the trace in `BIN_S` bins."""
    if not trace:
        return [], []
    bins = [0.0] * (math.floor(max(r.at for r in trace) / BIN_S) + 1)
    for r in trace:
        bins[math.floor(r.at / BIN_S)] += r.prompt_tokens / BIN_S
    return [k * BIN_S for k in range(len(bins))], bins


def draw(
    trace: Sequence[TraceRequest],
    runs: Mapping[str, Run],
    forecasts: Mapping[str, tuple[float, list[dict[str, object]]]],
    path: Path,
    *,
    title: str,
    subtitle: str = "",
) -> None:
    """Draw the trace, the forecasts (way → (its run's start on the wall clock, its decisions)) and the
    runs (label → run) into `path`."""
    import matplotlib
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11.0, 7.5), layout="constrained")
    load_axes, count_axes = figure.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    starts, rates = arrivals(trace)
    load_axes.step(starts, rates, where="post", color="#999999", linewidth=1.0, label="arrivals (1 s bins)")
    for index, (way, (origin, events)) in enumerate(forecasts.items()):
        points = [
            (float(str(e["ts"])) - origin, float(str(f["arriving_tokens_per_s"])))
            for e in events
            if e.get("role") == "prefill" and isinstance(f := e.get("forecast"), dict)
        ]
        points = [(t, y) for t, y in points if t >= 0.0]
        if points:
            load_axes.step([t for t, _ in points], [y for _, y in points], where="post", linewidth=1.3,
                           color=COLOURS[(index + 3) % len(COLOURS)], label=f"{way}: forecast")  # fmt: skip
    load_axes.set_ylabel("prompt tokens / s")
    load_axes.set_ylim(bottom=0)
    load_axes.legend(loc="upper left", fontsize="small", ncol=2)
    load_axes.set_title(title)
    for index, (label, run) in enumerate(runs.items()):
        span = max((o.end for o in run.outcomes), default=0.0)
        samples = [s for s in run.samples if 0.0 <= s.at <= span]
        count_axes.step([s.at for s in samples], [s.active for s in samples], where="post", linewidth=1.4,
                        color=COLOURS[index % len(COLOURS)], label=label, alpha=0.85)  # fmt: skip
    count_axes.set_ylabel("replicas not Inactive")
    count_axes.set_xlabel("seconds from the trace's start (as replayed)")
    count_axes.set_ylim(bottom=0)
    count_axes.legend(loc="upper left", fontsize="small", ncol=4)
    for axes in (load_axes, count_axes):
        axes.grid(True, alpha=0.3)
    command = "python -m engine.bench " + " ".join(shlex.quote(a) for a in _without_logs(sys.argv[1:]))
    caption = f"{cpu_name()}, {command}"
    if subtitle:
        caption += f"\n{subtitle}"
    figure.supxlabel(caption, fontsize="x-small", color="#555555")
    with matplotlib.rc_context({"svg.hashsalt": "zigzag-trace", "svg.fonttype": "none"}):
        figure.savefig(path, dpi=110, metadata={"Date": None} if path.suffix == ".svg" else None)
