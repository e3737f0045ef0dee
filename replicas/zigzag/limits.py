"""How much work the router offers a NewPrefill replica (architecture §8).

A NewPrefill replica runs only the layers it has, so every batch it takes is finished by its OldPrefill
partner. It takes a few batches at a time, fewer as the episode goes on — the anchor system's schedule:
4 batches for the first 200 ms, then 3 for the next 200 ms, then 2 — so the partner is never swamped.
A batch counts from the moment the replica takes its first request until it is handed over or finished.
"""

from __future__ import annotations

# (seconds since entering NewPrefill, batches allowed until then); the last entry holds afterwards.
BATCH_LIMITS: tuple[tuple[float, int], ...] = ((0.2, 4), (0.4, 3), (float("inf"), 2))


def batch_limit(seconds_in_state: float) -> int:
    """How many batches a NewPrefill replica may hold `seconds_in_state` after it entered the state."""
    for until, limit in BATCH_LIMITS:
        if seconds_in_state < until:
            return limit
    return BATCH_LIMITS[-1][1]
