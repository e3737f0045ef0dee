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

from matplotlib.figure import Figure
from matplotlib.patches import Patch

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


def draw_timeline(
    timeline: Timeline, path: str | Path, *, title: str | None = None, width: float = 12.0
) -> None:
    """Draw `timeline` into `path` (PNG unless the suffix says otherwise). Raises OSError when the file
    cannot be written."""
    lanes = timeline.lanes
    rows = max(timeline.rows, 1)
    lane_height = 0.45 * max(len(lanes), 1) + 0.6
    request_height = min(0.12 * rows, 6.0) + 0.6
    figure = Figure(figsize=(width, lane_height + request_height + 1.2), layout="constrained")
    top, bottom = figure.subplots(2, 1, sharex=True, height_ratios=[lane_height, request_height])

    states_used: list[str] = []
    for index, lane in enumerate(lanes):
        y = len(lanes) - 1 - index
        for segment in lane.segments:
            if segment.state not in states_used:
                states_used.append(segment.state)
            top.broken_barh(
                [(segment.start, max(segment.end - segment.start, 0.0))],
                (y - 0.35, 0.7),
                facecolors=STATE_COLOURS.get(segment.state, UNKNOWN_COLOUR),
                edgecolors="white",
                linewidth=0.5,
            )
        for lock in lane.locks:
            top.broken_barh(
                [(lock.start, max(lock.end - lock.start, 0.0))],
                (y - 0.35, 0.7),
                facecolors="none",
                edgecolors="black",
                hatch="///",
                linewidth=0.8,
            )
        for failure in lane.failures:
            top.plot([failure.at], [y], marker="X", color="#c0392b", markersize=10, linestyle="none")
    top.set_yticks(range(len(lanes)), [lane.replica for lane in reversed(lanes)])
    top.set_ylim(-0.6, max(len(lanes), 1) - 0.4)
    top.set_title(title or "replica states")
    ordered = [state for state in STATE_COLOURS if state in states_used]
    ordered += [state for state in states_used if state not in STATE_COLOURS]
    handles = [Patch(facecolor=STATE_COLOURS.get(state, UNKNOWN_COLOUR), label=state) for state in ordered]
    if any(lane.locks for lane in lanes):
        handles.append(Patch(facecolor="none", edgecolor="black", hatch="///", label="locked"))
    if handles:
        top.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")

    phases_used: list[str] = []
    for span in timeline.requests:
        y = -span.row
        bottom.plot([span.start, span.end], [y, y], color="#bbbbbb", linewidth=0.6)
        for phase in span.phases:
            if phase.name not in phases_used:
                phases_used.append(phase.name)
            bottom.broken_barh(
                [(phase.start, max(phase.end - phase.start, 0.0))],
                (y - 0.3, 0.6),
                facecolors=PHASE_COLOURS.get(phase.name, UNKNOWN_COLOUR),
            )
        if span.outcome in OUTCOME_MARKERS:
            marker, colour = OUTCOME_MARKERS[span.outcome]
            bottom.plot([span.end], [y], marker=marker, color=colour, markersize=6, linestyle="none")
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
