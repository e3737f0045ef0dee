"""The timeline picture: one lane per replica coloured by state, lock periods hatched, failures marked,
and the requests' phases beneath on the same time axis.

Needs matplotlib (the optional extra ``plot``: ``pip install 'zigzag[plot]'``); importing this module
without it raises ModuleNotFoundError, which the command turns into that advice. It draws on a
`matplotlib.figure.Figure` (no pyplot, no global state, no display) and writes the file in the format its
suffix names (PNG, SVG, PDF).
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.collections import LineCollection, PolyCollection
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from engine.logs.timeline import Timeline

STATE_COLOURS: Final[dict[str, str]] = {
    "Inactive": "#d9d9d9",
    "LoadingEncode": "#cdb4db",
    "LoadingPrefill": "#a9c7e8",
    "LoadingDecode": "#b7e1b0",
    "Encode": "#7b4fa0",
    "Prefill": "#2f6db5",
    "Decode": "#2e9e4f",
    "NewPrefill": "#5fa8d3",
    "OldPrefill": "#1b4f8a",
    "RefractoryPrefill": "#8fb8de",
    "MutatingToDecode": "#17a2a2",
    "AusPrefill": "#6b8e23",
    "AusDecode": "#9acd32",
    "ShuttingEncode": "#f4a261",
    "ShuttingPrefill": "#f4a261",
    "ShuttingDecode": "#e76f51",
    "ShuttingNull": "#b23a48",
}
PHASE_COLOURS: Final[dict[str, str]] = {
    "queued": "#c8c8c8",
    "encode": "#7b4fa0",
    "embedding_transfer": "#e377c2",
    "prefill": "#2f6db5",
    "kv_transfer": "#ff9f1c",
    "decode": "#2e9e4f",
}
OUTCOME_MARKERS: Final[dict[str, tuple[str, str]]] = {"failed": ("x", "#c0392b"), "cancelled": ("|", "black")}
UNKNOWN_COLOUR: Final = "#999999"


class _Boxes:
    """Rectangles grouped by style, drawn as one collection per style: a timeline of thousands of
    requests stays thousands of vertices, not thousands of artists."""

    def __init__(self) -> None:
        self._groups: dict[tuple[str, str, str], list[list[tuple[float, float]]]] = {}

    def add(
        self, start: float, end: float, y: float, half_height: float, style: tuple[str, str, str]
    ) -> None:
        end = max(end, start)
        low, high = y - half_height, y + half_height
        self._groups.setdefault(style, []).append([(start, low), (end, low), (end, high), (start, high)])

    def draw(self, axes: Axes) -> None:
        for (face, edge, hatch), boxes in self._groups.items():
            axes.add_collection(
                PolyCollection(
                    boxes,
                    facecolors=face,
                    edgecolors=edge,
                    hatch=hatch or None,
                    # Fills get no outline: at a few pixels per box an outline would paint over its
                    # neighbours (a busy timeline is thousands of boxes); lock periods keep theirs.
                    linewidths=0.6 if hatch else 0.0,
                )
            )


def draw_timeline(
    timeline: Timeline, path: str | Path, *, title: str | None = None, width: float = 12.0
) -> None:
    """Draw `timeline` into `path` (PNG unless the suffix says otherwise). Raises OSError when the file
    cannot be written."""
    lanes = timeline.lanes
    rows = max(timeline.rows, 1)
    lane_height = 0.45 * max(len(lanes), 1) + 0.6
    request_height = min(0.12 * rows, 6.0) + 0.6
    figure = Figure(figsize=(width, lane_height + request_height + 2.6), layout="constrained")
    top, middle, bottom = figure.subplots(3, 1, sharex=True, height_ratios=[lane_height, 1.4, request_height])
    _draw_counts(middle, timeline)

    states_used: set[str] = set()
    boxes = _Boxes()
    failures_x: list[float] = []
    failures_y: list[float] = []
    for index, lane in enumerate(lanes):
        y = len(lanes) - 1 - index
        for segment in lane.segments:
            states_used.add(segment.state)
            colour = STATE_COLOURS.get(segment.state, UNKNOWN_COLOUR)
            boxes.add(segment.start, segment.end, y, 0.35, (colour, "none", ""))
        for lock in lane.locks:
            boxes.add(lock.start, lock.end, y, 0.35, ("none", "black", "///"))
        failures_x.extend(failure.at for failure in lane.failures)
        failures_y.extend(y for _ in lane.failures)
    boxes.draw(top)
    lane_y = {lane.replica: len(lanes) - 1 - index for index, lane in enumerate(lanes)}
    relays = [r for r in timeline.relays if r.new_prefill in lane_y and r.old_prefill in lane_y]
    for relay in relays:  # a ZigZag relay: a line from the NewPrefill lane to its OldPrefill lane
        between = (lane_y[relay.new_prefill], lane_y[relay.old_prefill])
        top.plot((relay.at, relay.at), between, color="#e76f51", linewidth=0.8, marker="v", markersize=3)
    if failures_x:
        top.plot(failures_x, failures_y, marker="X", color="#c0392b", markersize=10, linestyle="none")
    top.set_yticks(range(len(lanes)), [lane.replica for lane in reversed(lanes)])
    top.set_ylim(-0.6, max(len(lanes), 1) - 0.4)
    top.set_title(title or "replica states")
    ordered = [state for state in STATE_COLOURS if state in states_used]
    ordered += sorted(state for state in states_used if state not in STATE_COLOURS)
    handles: list[Artist] = [
        Patch(facecolor=STATE_COLOURS.get(state, UNKNOWN_COLOUR), label=state) for state in ordered
    ]
    if any(lane.locks for lane in lanes):
        handles.append(Patch(facecolor="none", edgecolor="black", hatch="///", label="locked"))
    if relays:
        layers = sorted({r.layer for r in relays})
        label = f"relay (after layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, layers))})"
        handles.append(Line2D([], [], color="#e76f51", marker="v", markersize=3, label=label))
    if handles:
        top.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")

    phases_used: set[str] = set()
    phase_boxes = _Boxes()
    spans: list[list[tuple[float, float]]] = []
    ends: dict[str, tuple[list[float], list[float]]] = {outcome: ([], []) for outcome in OUTCOME_MARKERS}
    for span in timeline.requests:
        y = -span.row
        spans.append([(span.start, y), (span.end, y)])
        for phase in span.phases:
            phases_used.add(phase.name)
            colour = PHASE_COLOURS.get(phase.name, UNKNOWN_COLOUR)
            phase_boxes.add(phase.start, phase.end, y, 0.3, (colour, "none", ""))
        if span.outcome in ends:
            ends[span.outcome][0].append(span.end)
            ends[span.outcome][1].append(y)
    bottom.add_collection(LineCollection(spans, colors="#bbbbbb", linewidths=0.6))
    phase_boxes.draw(bottom)
    for outcome, (xs, ys) in ends.items():
        if xs:
            marker, colour = OUTCOME_MARKERS[outcome]
            bottom.plot(xs, ys, marker=marker, color=colour, markersize=6, linestyle="none")
    bottom.set_ylim(-rows + 0.4, 0.6)
    bottom.set_yticks([])
    bottom.set_ylabel(f"requests ({len(timeline.requests)})")
    bottom.set_xlabel("seconds since the first event")
    bottom.set_xlim(0.0, max(timeline.end, 1e-3))
    phase_handles = [
        Patch(facecolor=colour, label=name) for name, colour in PHASE_COLOURS.items() if name in phases_used
    ]
    if phase_handles:
        bottom.legend(handles=phase_handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    figure.savefig(path, dpi=110)


def _draw_counts(axes: Axes, timeline: Timeline) -> None:
    """Replicas per role (not Inactive) and requests in flight, as steps over time."""
    points = timeline.counts
    if not points:
        axes.set_visible(False)
        return
    xs = [p.at for p in points] + [timeline.end]
    for role, colour in (("prefill", "#2a9d8f"), ("decode", "#264653"), ("encode", "#e9c46a")):
        ys = [getattr(p, role) for p in points]
        if any(ys):
            axes.step(xs, [*ys, ys[-1]], where="post", color=colour, label=f"{role} replicas")
    axes.set_ylabel("replicas")
    axes.yaxis.set_major_locator(MaxNLocator(integer=True))  # replicas and requests come whole
    axes.set_ylim(bottom=0)
    load = axes.twinx()
    flights = [p.in_flight for p in points]
    load.step(xs, [*flights, flights[-1]], where="post", color="#bbbbbb", linewidth=0.8, label="in flight")
    load.set_ylabel("requests in flight")
    load.yaxis.set_major_locator(MaxNLocator(integer=True))
    load.set_ylim(bottom=0)
    handles, labels = axes.get_legend_handles_labels()
    more, more_labels = load.get_legend_handles_labels()
    axes.legend(
        handles + more, labels + more_labels, loc="upper left", bbox_to_anchor=(1.06, 1.0), fontsize="small"
    )
