"""The planner's targets: how many replicas each role needs, from the load it carries (docs/planner.md).

Each signal gives a *range* of replica counts that keeps the role's utilisation between a lower and an
upper bound; the planner keeps the current count while it lies in the range and otherwise moves to the
middle of it (BlitzScale's rule):

- decode by KV memory: `used blocks / (upper × blocks per replica)` … `used / (lower × blocks per replica)`;
- decode by KV-migration bandwidth: `migration bytes/s / (upper × bytes/s one replica takes)` … `/ lower`;
- prefill by waiting prompt tokens: the prompt tokens per second the role must prefill — those arriving
  plus the backlog drained within `drain_s` — over one replica's measured prefill tokens/s, `/ upper`
  … `/ lower`.

Decode takes the larger of its two ranges. Counts are clamped to `[minimum, maximum]`; a scale-down
removes at most one replica per pass. Pure functions: no clock, no node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import final


@final
@dataclass(frozen=True, slots=True)
class Bounds:
    """Utilisation bounds of one signal: the planner scales up above `upper`, down below `lower`."""

    lower: float
    upper: float

    def __post_init__(self) -> None:
        if not 0.0 < self.lower < self.upper <= 1.0:
            raise ValueError(
                f"utilisation bounds need 0 < lower < upper <= 1, got {self.lower}, {self.upper}"
            )


@final
@dataclass(frozen=True, slots=True)
class Range:
    """Replica counts that keep a signal within its bounds: `[low, high]` (low ≤ high)."""

    low: int
    high: int

    @property
    def middle(self) -> int:
        return (self.low + self.high + 1) // 2

    def widest(self, other: Range) -> Range:
        """The range that satisfies the more demanding of two signals."""
        return Range(max(self.low, other.low), max(self.high, other.high))


def needed(demand: float, capacity: float, bounds: Bounds) -> Range:
    """Replicas of `capacity` each that carry `demand` at a utilisation within `bounds`."""
    if demand <= 0.0:
        return Range(0, 0)
    if capacity <= 0.0:
        raise ValueError(f"capacity per replica must be positive, got {capacity}")
    low = math.ceil(demand / (bounds.upper * capacity) - 1e-9)  # the fewest at or below `upper`
    high = max(low, math.floor(demand / (bounds.lower * capacity) + 1e-9))  # the most at or above `lower`
    return Range(low, high)


def decode_by_memory(used_blocks: int, blocks_per_replica: int, bounds: Bounds) -> Range:
    return needed(float(used_blocks), float(blocks_per_replica), bounds)


def decode_by_migration(bytes_per_s: float, bytes_per_s_per_replica: float, bounds: Bounds) -> Range:
    if bytes_per_s_per_replica <= 0.0:
        return Range(0, 0)  # nothing measured yet: the signal says nothing
    return needed(bytes_per_s, bytes_per_s_per_replica, bounds)


def prefill_by_tokens(
    arriving_tokens_per_s: float,
    waiting_tokens: int,
    tokens_per_s_per_replica: float,
    bounds: Bounds,
    *,
    drain_s: float,
) -> Range:
    if tokens_per_s_per_replica <= 0.0:
        return Range(0, 0)
    demand = arriving_tokens_per_s + waiting_tokens / drain_s
    return needed(demand, tokens_per_s_per_replica, bounds)


def target(current: int, wanted: Range, *, minimum: int, maximum: int) -> int:
    """The count to move to: `current` while it lies in `wanted`, else its middle; clamped to
    `[minimum, maximum]`; a scale-down goes one replica at a time."""
    chosen = current if wanted.low <= current <= wanted.high else wanted.middle
    chosen = min(max(chosen, minimum), maximum)
    if chosen < current:
        chosen = current - 1
    return chosen
