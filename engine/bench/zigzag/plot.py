"""The `zigzag` benchmark's picture: TTFT around the scale-up, one series per run, from the nodes' logs.

Each request is a point at its arrival (its `first_token` event's time less its `ttft_s`), seconds from
the scale (the new replica's `LoadingPrefill`, commanded by the planner); the span from the scale to the
new replica serving every layer (`Prefill`) is shaded in the run's colour. Needs matplotlib (the extra
`plot`); draws on a `Figure` (no pyplot) and writes the format the suffix names. The caption names the
CPU and the command (less `--logs`).
"""

from __future__ import annotations

import platform
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from engine.bench.nodes import read_events

COLOURS: Final = ("#d1495b", "#2f6db5", "#2e9e4f", "#7b4fa0")
MARKERS: Final = ("x", "o", "^", "s")


def cpu_name() -> str:
    """The CPU's model name (`lscpu`'s "Model name"), or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def scale_span(events: list[dict[str, Any]]) -> tuple[float, float | None] | None:
    """(ts of the scale, ts the new replica first served every layer or None) from a node's log."""
    states = [e for e in events if e.get("event") == "replica_state"]
    commanded = [e for e in states if e.get("to") == "LoadingPrefill" and e.get("reason") != "node command"]
    if not commanded:
        return None
    start = commanded[0]
    served = [
        e["ts"]
        for e in states
        if e["replica"] == start["replica"] and e.get("to") == "Prefill" and e["ts"] >= start["ts"]
    ]
    return float(start["ts"]), (float(served[0]) if served else None)


def ttft_points(events: list[dict[str, Any]], origin: float) -> tuple[list[float], list[float]]:
    """(arrival s from `origin`, TTFT s) of every request's first token."""
    xs: list[float] = []
    ys: list[float] = []
    for event in events:
        if event.get("event") == "first_token" and event.get("ttft_s") is not None:
            xs.append(float(event["ts"]) - float(event["ttft_s"]) - origin)
            ys.append(float(event["ttft_s"]))
    return xs, ys


def _without_logs(argv: list[str]) -> list[str]:
    """The command line less `--logs DIR`, which changes no figure."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip or arg == "--logs":
            skip = not skip
            continue
        if not arg.startswith("--logs="):
            kept.append(arg)
    return kept


def draw_ttft(logs: Mapping[str, Path], path: Path, *, subtitle: str = "") -> None:
    """Draw the runs' logs (label → log file) into `path`."""
    import matplotlib
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10.0, 5.2), layout="constrained")
    axes = figure.subplots()
    left = 0.0
    for index, (label, log_file) in enumerate(logs.items()):
        events = read_events(log_file)
        span = scale_span(events)
        if span is None:
            continue
        origin, served = span
        xs, ys = ttft_points(events, origin)
        colour = COLOURS[index % len(COLOURS)]
        if served is not None:
            axes.axvspan(0.0, served - origin, color=colour, alpha=0.12, linewidth=0)
            axes.axvline(served - origin, color=colour, linestyle=":", linewidth=1.2)
            label += f" (new replica serves all layers at +{served - origin:.2f} s)"
        marker = MARKERS[index % len(MARKERS)]
        axes.plot(xs, ys, marker=marker, linestyle="none", markersize=4.5, color=colour, label=label,
                  markerfacecolor="none" if marker != "x" else colour)  # fmt: skip
        left = min(left, min(xs, default=0.0))
    axes.axvline(0.0, color="black", linestyle="--", linewidth=1.0)
    axes.annotate("scale prefill 1 → 2; rate × 3", (0.0, 0.8), xycoords=("data", "axes fraction"),
                  xytext=(-4, -12), textcoords="offset points", fontsize="small", ha="right")  # fmt: skip
    axes.set_xlim(left=max(left, -3.0) - 0.2)
    axes.set_ylim(bottom=0.0)
    axes.set_xlabel("request arrival, seconds from the scale")
    axes.set_ylabel("time to first token (s)")
    axes.set_title("TTFT around a prefill scale-up at a 3× burst: stop-the-world against ZigZag")
    axes.legend(loc="upper left", fontsize="small")
    axes.grid(True, alpha=0.3)
    command = "python -m engine.bench " + " ".join(shlex.quote(a) for a in _without_logs(sys.argv[1:]))
    caption = f"{cpu_name()}, {command}"
    if subtitle:
        caption += f"\n{subtitle}"
    figure.supxlabel(caption, fontsize="x-small", color="#555555")
    with matplotlib.rc_context({"svg.hashsalt": "zigzag-ttft", "svg.fonttype": "none"}):
        figure.savefig(path, dpi=110, metadata={"Date": None} if path.suffix == ".svg" else None)
