"""Replica counts per role over time, and the requests in flight: the `timeline`'s scaling view.

A replica counts for its role (from its name, `{role}-{n}` or `{node}/{role}-{n}`) while it is in any
state but `Inactive` — loading and `ShuttingNull` included, as the planner's replica-seconds count it.
A request is in flight from its arrival to its end. Both are step series: a `CountPoint` holds from its
`at` until the next one.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

ROLES = ("encode", "prefill", "decode")


class CountPoint(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    at: float
    encode: int
    prefill: int
    decode: int
    in_flight: int


def role_of(replica: str) -> str | None:
    role = replica.rpartition("/")[2].partition("-")[0]
    return role if role in ROLES else None


def count_series(
    lanes: Sequence[tuple[str, Sequence[tuple[str, float, float | None]]]],
    requests: Sequence[tuple[float, float | None]],
) -> list[CountPoint]:
    """The step series of `lanes` (replica, [(state, start, end)]) and `requests` ([(start, end)]); an
    end of None: still so when the log ended."""
    changes: list[tuple[float, str, int]] = []
    for replica, segments in lanes:
        role = role_of(replica)
        if role is None:
            continue
        for state, start, end in segments:
            if state != "Inactive":
                changes.append((start, role, 1))
                if end is not None:
                    changes.append((end, role, -1))
    for start, end in requests:
        changes.append((start, "in_flight", 1))
        if end is not None:
            changes.append((end, "in_flight", -1))
    changes.sort(key=lambda change: (change[0], change[2]))  # an end before a start at the same time
    counts = dict.fromkeys((*ROLES, "in_flight"), 0)
    points: list[CountPoint] = []
    for index, (at, key, delta) in enumerate(changes):
        counts[key] += delta
        if index + 1 < len(changes) and changes[index + 1][0] == at:
            continue  # one point per instant
        points.append(CountPoint(at=at, **counts))
    return points
