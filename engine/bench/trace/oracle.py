"""The `trace` benchmark's oracle: a schedule of prefill replica counts made from the trace's own arrivals,
played on a node without a planner through `scale` commands — what a planner that knew the future could
do with the same replicas, copies and rules.

`schedule(trace, …)`: on a grid of `STEP_S` seconds, the load at `t` is the prompt tokens per second
arriving in `[t, t + window)`; it needs the fewest replicas that carry it at the band's `upper`
utilisation of one replica's `capacity` tokens/s, within `[minimum, maximum]`. A command at `c` asks for
the most that the load needs over `[c, c + lead]`: a replica asked for then serves `lead` seconds later
(a weight copy from a peer and its start-up). The schedule is the list of changes, each `(c, count)`.

`player(plan, keep_alive)` is the replay's `control`: at each change it sends `scale prefill COUNT` (up:
ZigZag, weights from any source; down: the replicas drain as a planner's do), and a poller makes
`ShuttingNull` replicas `Inactive` once they have idled `keep_alive` seconds, as the planner does.
"""

from __future__ import annotations

import bisect
import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

import trio

from engine.bench.trace.gen import TraceRequest
from engine.bench.trace.replay import Control

if TYPE_CHECKING:
    from engine.client import ControlClient

STEP_S: Final = 0.25
POLL_S: Final = 0.1


def schedule(
    trace: Sequence[TraceRequest],
    *,
    capacity: float,
    upper: float,
    window: float,
    lead: float,
    minimum: int,
    maximum: int,
) -> list[tuple[float, int]]:
    """See the module docstring."""
    if not trace or capacity <= 0 or window <= 0:
        return []
    starts = [r.at for r in trace]
    sums = [0]
    for r in trace:
        sums.append(sums[-1] + r.prompt_tokens)
    end = starts[-1] + window
    grid = [k * STEP_S for k in range(math.ceil(end / STEP_S) + 1)]

    def rate(at: float) -> float:
        lo, hi = bisect.bisect_left(starts, at), bisect.bisect_left(starts, at + window)
        return (sums[hi] - sums[lo]) / window

    need = [min(max(math.ceil(rate(t) / (upper * capacity) - 1e-9), minimum), maximum) for t in grid]
    ahead = max(1, math.ceil(lead / STEP_S))
    plan: list[tuple[float, int]] = []
    current = None
    for i, t in enumerate(grid):
        count = max(need[i : i + ahead + 1])
        if count != current:
            plan.append((t, count))
            current = count
    return plan


def player(plan: Sequence[tuple[float, int]], keep_alive: float) -> Control:
    """The replay's `control` that plays `plan` (see the module docstring)."""

    async def play(client: ControlClient, started: float) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_release, client, keep_alive)
            current = None
            for at, count in plan:
                await trio.sleep_until(started + at)
                if current is None:
                    current = count
                    if count == 1:
                        continue  # the node starts with one
                await _scale(client, count, up=count > current)
                current = count
            # the poller goes on releasing until the replay ends and cancels this

    return play


async def _scale(client: ControlClient, count: int, *, up: bool) -> None:
    from engine.client import ControlError

    try:
        await client.scale("prefill", count, mode="zigzag" if up else None)
    except ControlError as exc:
        sys.stderr.write(f"trace: oracle: scale prefill {count} refused: {exc}\n")


async def _release(client: ControlClient, keep_alive: float) -> None:
    """Make `ShuttingNull` replicas `Inactive` after `keep_alive` seconds (cancelled with the plan)."""
    from engine.client import ControlError

    idle: dict[str, float] = {}
    while True:
        now = trio.current_time()
        status = await client.status()
        null = {r.name for r in status.replicas if r.state == "ShuttingNull"}
        idle = {name: idle.get(name, now) for name in null}
        for name, since in idle.items():
            if now - since >= keep_alive:
                try:
                    await client.transition(name, "Inactive")
                except ControlError:
                    pass  # revived by a scale-up meanwhile
        await trio.sleep(POLL_S)
