"""The replica state machine of architecture §6 (seed 004): states, roles, one table, the transitions.

`STATES` holds a row per state — the role it is for, its phase, whether it serves, counts as active,
which ZigZag side it is, what it settles to, what its main loop runs — and every set the node's parts ask
about is derived from it here (`SERVING_ROLE`, `ACTIVE_STATES`, `ZIGZAG_NEW`, `PREFILL_BATCHES`, ...);
no other module keeps a list of states. The one table keyed by state elsewhere is the conditions of the
automatic moves (`replicas.actor.moves.AUTOMATIC`), which must have a row for exactly the states this
table lets settle (`settles_to`; asserted there).

A transition is either *commanded* (the `transition` op, the planner, the controller) or *automatic* (the
replica moves itself when a condition holds: weights loaded, nothing left to finish — the table's
`settles_to`, under the condition `replicas.actor.moves` gives). `check_command` refuses every
commanded move that the table does not list, naming both states.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, final

Role = Literal["encode", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("encode", "prefill", "decode")


class ReplicaState(enum.Enum):
    """State names exactly as in the reference controller (and in `status` replies)."""

    INACTIVE = "Inactive"
    LOADING_PREFILL = "LoadingPrefill"
    LOADING_DECODE = "LoadingDecode"
    LOADING_ENCODE = "LoadingEncode"
    PREFILL = "Prefill"
    DECODE = "Decode"
    ENCODE = "Encode"
    NEW_PREFILL = "NewPrefill"
    OLD_PREFILL = "OldPrefill"
    REFRACTORY_PREFILL = "RefractoryPrefill"
    MUTATING_TO_DECODE = "MutatingToDecode"
    AUS_PREFILL = "AusPrefill"
    AUS_DECODE = "AusDecode"
    SHUTTING_PREFILL = "ShuttingPrefill"
    SHUTTING_DECODE = "ShuttingDecode"
    SHUTTING_ENCODE = "ShuttingEncode"
    SHUTTING_NULL = "ShuttingNull"


S = ReplicaState
Phase = Literal["inactive", "loading", "serving", "mutating", "reviving", "shutting", "parked"]
Work = Literal["prefill", "decode", "encode"]
ZigZagSide = Literal["new", "old"]


@final
@dataclass(frozen=True, slots=True)
class StateRow:
    """One state of the machine, in the columns every part of the node asks about.

    `role`: the role the state serves, loads, revives or leaves (None: none). `phase`: where in a
    replica's life it is. `serving`: it serves `role` now (`status` shows that role). `active`: it
    counts as one of `role`'s replicas for the `scale` op and the planner (serving, or on its way to).
    `zigzag`: its side of a ZigZag episode (architecture §8). `settles_to`: the state it moves to by
    itself once its condition holds (weights loaded, drained, flushed, no relays left) — the automatic
    rows of the transition table. `runs`: the compute its main loop starts (prefill batches, decode
    steps, encode jobs; None: none)."""

    role: Role | None
    phase: Phase
    serving: bool
    active: bool
    zigzag: ZigZagSide | None
    settles_to: ReplicaState | None
    runs: Work | None


# The one table: every set and predicate below (and those the node's parts use) is read from it.
# fmt: off
STATES: dict[ReplicaState, StateRow] = {
    #                              role       phase       serving active zigzag settles_to            runs
    S.INACTIVE:           StateRow(None,      "inactive", False,  False, None,  None,                 None),
    S.LOADING_PREFILL:    StateRow("prefill", "loading",  False,  True,  None,  S.PREFILL,            None),
    S.LOADING_DECODE:     StateRow("decode",  "loading",  False,  True,  None,  S.DECODE,             None),
    S.LOADING_ENCODE:     StateRow("encode",  "loading",  False,  True,  None,  S.ENCODE,             None),
    S.PREFILL:            StateRow("prefill", "serving",  True,   True,  None,  None,                 "prefill"),
    S.DECODE:             StateRow("decode",  "serving",  True,   True,  None,  None,                 "decode"),
    S.ENCODE:             StateRow("encode",  "serving",  True,   True,  None,  None,                 "encode"),
    S.NEW_PREFILL:        StateRow("prefill", "serving",  True,   True,  "new", S.REFRACTORY_PREFILL, "prefill"),
    S.OLD_PREFILL:        StateRow("prefill", "serving",  True,   True,  "old", S.PREFILL,            "prefill"),
    S.REFRACTORY_PREFILL: StateRow("prefill", "serving",  True,   True,  "new", S.PREFILL,            "prefill"),
    S.MUTATING_TO_DECODE: StateRow("decode",  "mutating", False,  True,  None,  S.DECODE,             "decode"),
    S.AUS_PREFILL:        StateRow("prefill", "reviving", False,  True,  None,  S.PREFILL,            None),
    S.AUS_DECODE:         StateRow("decode",  "reviving", False,  True,  None,  S.DECODE,             None),
    S.SHUTTING_PREFILL:   StateRow("prefill", "shutting", False,  False, None,  S.SHUTTING_NULL,      "prefill"),
    S.SHUTTING_DECODE:    StateRow("decode",  "shutting", False,  False, None,  S.SHUTTING_NULL,      "decode"),
    S.SHUTTING_ENCODE:    StateRow("encode",  "shutting", False,  False, None,  S.SHUTTING_NULL,      "encode"),
    S.SHUTTING_NULL:      StateRow(None,      "parked",   False,  False, None,  None,                 None),
}
# fmt: on


class Trigger(enum.Enum):
    COMMAND = "command"
    AUTOMATIC = "automatic"


# The commanded moves; the automatic ones are the table's `settles_to`.
COMMANDED: tuple[tuple[ReplicaState, ReplicaState], ...] = (
    (S.INACTIVE, S.LOADING_PREFILL),
    (S.INACTIVE, S.LOADING_DECODE),
    (S.INACTIVE, S.LOADING_ENCODE),
    (S.LOADING_PREFILL, S.NEW_PREFILL),
    (S.PREFILL, S.OLD_PREFILL),
    (S.PREFILL, S.MUTATING_TO_DECODE),
    (S.PREFILL, S.SHUTTING_PREFILL),
    (S.DECODE, S.SHUTTING_DECODE),
    (S.ENCODE, S.SHUTTING_ENCODE),
    (S.SHUTTING_NULL, S.AUS_PREFILL),
    (S.SHUTTING_NULL, S.AUS_DECODE),
    (S.SHUTTING_NULL, S.INACTIVE),
)
TRANSITIONS: dict[tuple[ReplicaState, ReplicaState], Trigger] = {
    **{move: Trigger.COMMAND for move in COMMANDED},
    **{(state, row.settles_to): Trigger.AUTOMATIC for state, row in STATES.items() if row.settles_to},
}

# Commands that start ZigZag states (architecture §8): they pair a NewPrefill with an OldPrefill replica.
ZIGZAG_STARTS = frozenset(move for move in COMMANDED if STATES[move[1]].zigzag is not None)


def _states(keep: Callable[[StateRow], bool]) -> frozenset[ReplicaState]:
    return frozenset(state for state, row in STATES.items() if keep(row))


def _by_role(phase: Phase) -> dict[Role, ReplicaState]:
    return {row.role: state for state, row in STATES.items() if row.phase == phase and row.role is not None}


# The role a replica serves in each state (absent: it serves nothing), and the role each state is for.
SERVING_ROLE: dict[ReplicaState, Role] = {s: r.role for s, r in STATES.items() if r.serving and r.role}
STATE_ROLE: dict[ReplicaState, Role] = {s: r.role for s, r in STATES.items() if r.role is not None}
# Where a commanded start, stop and revival of each role lead.
LOADING_STATE: dict[Role, ReplicaState] = _by_role("loading")
SHUTTING_STATE: dict[Role, ReplicaState] = _by_role("shutting")
REVIVING_STATE: dict[Role, ReplicaState] = _by_role("reviving")
# The replicas of each role for `scale` and the planner: serving it, or on their way to.
ACTIVE_STATES: dict[Role, frozenset[ReplicaState]] = {
    role: frozenset(s for s, row in STATES.items() if row.active and row.role == role) for role in ROLES
}
# Serving plainly: no episode, nothing to settle (the states a scale-down stops, a cluster sends work to).
SETTLED = _states(lambda row: row.serving and row.settles_to is None)
ZIGZAG = _states(lambda row: row.zigzag is not None)
ZIGZAG_NEW = _states(lambda row: row.zigzag == "new")
ZIGZAG_OLD = _states(lambda row: row.zigzag == "old")
# A ZigZag partner for a new NewPrefill: a replica a command may move into OldPrefill, or an OldPrefill
# (which takes one more partner).
PAIRABLE = frozenset(a for a, b in COMMANDED if STATES[b].zigzag == "old") | ZIGZAG_OLD
# The state a commanded ZigZag start leads to on each side (a new side takes OldPrefill partners there).
EPISODE_START: dict[ZigZagSide, ReplicaState] = {
    side: b for _, b in ZIGZAG_STARTS if (side := STATES[b].zigzag) is not None
}
# What the main loop runs: prefill batches from the own queue (the new side runs its part batches),
# decode steps, encode jobs; a prefill-side state also migrates its prompts' KV.
PREFILL_BATCHES = _states(lambda row: row.runs == "prefill" and row.zigzag != "new")
DECODE_STEPS = _states(lambda row: row.runs == "decode")
ENCODE_JOBS = _states(lambda row: row.runs == "encode")
MIGRATES_KV = _states(lambda row: row.runs == "prefill")
# Keeps an image request whose embeddings landed (outside an episode; else it goes back to the router).
KEEPS_IMAGE_REQUESTS = _states(lambda row: row.runs == "prefill" and row.zigzag is None)


@final
class InvalidTransition(Exception):
    """A transition the state table does not allow (the message names both states and why); the
    replica refuses the command with `invalid_transition`."""


def parse_state(name: str) -> ReplicaState:
    """The state called `name` (as written in architecture §6), or ValueError listing the valid names."""
    try:
        return ReplicaState(name)
    except ValueError:
        valid = ", ".join(state.value for state in ReplicaState)
        raise ValueError(f"unknown replica state {name!r}; valid states: {valid}") from None


def check_command(replica: str, current: ReplicaState, target: ReplicaState) -> None:
    """Raise unless `replica` may be *commanded* from `current` to `target`."""
    if TRANSITIONS.get((current, target)) is not Trigger.COMMAND:
        automatic = TRANSITIONS.get((current, target)) is Trigger.AUTOMATIC
        why = " (that move happens automatically)" if automatic else ""
        allowed = sorted(
            to.value for (frm, to), how in TRANSITIONS.items() if frm is current and how is Trigger.COMMAND
        )
        hint = f"; from {current.value} you can command: {', '.join(allowed)}" if allowed else ""
        raise InvalidTransition(f"{replica}: cannot move from {current.value} to {target.value}{why}{hint}")


def check_automatic(replica: str, current: ReplicaState, target: ReplicaState) -> None:
    """Assert an automatic move is in the table (a bug otherwise, not a user error)."""
    if TRANSITIONS.get((current, target)) is not Trigger.AUTOMATIC:
        raise AssertionError(
            f"{replica}: automatic move {current.value} -> {target.value} is not in the table"
        )
