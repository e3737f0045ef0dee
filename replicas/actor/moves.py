"""A replica's automatic moves (architecture §6): one table, evaluated once per main-loop pass.

Every state the state table lets settle (`replicas.states.STATES`, column `settles_to`) has one row
here: the condition under which it moves on by itself, and the reason its `ReplicaStateChanged` event
gives. No other place decides an automatic move. The conditions read one `Progress` — a frozen picture
of the replica's work, taken once per pass after the inbox batch was applied and the current state's
upkeep ran, before the next compute starts — so a move never depends on a value read half-way through
a change, and at most one move happens per pass (the move wakes the loop for the next one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, final

from replicas.states import STATES, ReplicaState

S = ReplicaState


@final
@dataclass(frozen=True, slots=True)
class Progress:
    """What the automatic moves look at, at one point of a pass.

    `weights_landed`: the load the state waited for is done (a `Loading*` state, or `NewPrefill`).
    `preparing`: decode graphs are being captured for a role change. `busy`: a compute is in flight.
    `prompts_queued`: prompts wait in the prefill queue. `migrating`: prefilled requests wait for, or
    are in, a KV migration out. `zigzag_batches`: the new side of ZigZag still holds batches (not yet
    finished or handed over). `episode_over`: the old side has no partner left to relay with and no
    relayed batch in hand. `relay_running`: the compute in flight is a relayed batch. `decoding`:
    decodes run, or their KV is arriving. `encoding`: encode jobs are queued or in flight."""

    weights_landed: bool = False
    preparing: bool = False
    busy: bool = False
    prompts_queued: bool = False
    migrating: bool = False
    zigzag_batches: bool = False
    episode_over: bool = False
    relay_running: bool = False
    decoding: bool = False
    encoding: bool = False


@final
@dataclass(frozen=True, slots=True)
class Settles:
    """A row of `AUTOMATIC`: the state moves to its `settles_to` when `when` holds, giving `reason`."""

    when: Callable[[Progress], bool]
    reason: str


def _loaded(p: Progress) -> bool:
    return p.weights_landed


def _revived(p: Progress) -> bool:
    return not p.preparing


_LOADED = Settles(_loaded, "weights loaded")
_REVIVED = Settles(_revived, "revived")

# fmt: off
AUTOMATIC: Final[dict[ReplicaState, Settles]] = {
    S.LOADING_PREFILL:    _LOADED,
    S.LOADING_DECODE:     _LOADED,
    S.LOADING_ENCODE:     _LOADED,
    S.NEW_PREFILL:        _LOADED,
    S.REFRACTORY_PREFILL: Settles(lambda p: not p.zigzag_batches and not p.busy,
                                  "every ZigZag batch finished or handed over"),
    S.OLD_PREFILL:        Settles(lambda p: p.episode_over and not p.relay_running, "no relays left"),
    S.MUTATING_TO_DECODE: Settles(lambda p: not (p.busy or p.migrating or p.prompts_queued or p.preparing),
                                  "flush adopted the queued migrations"),
    S.AUS_PREFILL:        _REVIVED,
    S.AUS_DECODE:         _REVIVED,
    S.SHUTTING_PREFILL:   Settles(lambda p: not (p.busy or p.prompts_queued or p.migrating),
                                  "no unfinished prefills or migrations"),
    S.SHUTTING_DECODE:    Settles(lambda p: not (p.busy or p.decoding), "no unfinished decodes"),
    S.SHUTTING_ENCODE:    Settles(lambda p: not (p.busy or p.encoding), "no unfinished encodes"),
}
# fmt: on
assert set(AUTOMATIC) == {state for state, row in STATES.items() if row.settles_to is not None}
# The states that wait for a load to land (the others keep nothing a load brings).
WAITS_FOR_WEIGHTS: Final = frozenset(state for state, row in AUTOMATIC.items() if row is _LOADED)


def due(state: ReplicaState, progress: Progress) -> tuple[ReplicaState, str] | None:
    """The automatic move `state` makes now (target, reason), or None. Pure."""
    row, settles = STATES[state], AUTOMATIC.get(state)
    if settles is None or row.settles_to is None or not settles.when(progress):
        return None
    return row.settles_to, settles.reason
