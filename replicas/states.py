"""The replica state machine of architecture §6 (seed 004): states, roles, and the transition table.

A transition is either *commanded* (the `transition` op, the planner, the controller) or *automatic* (the
replica moves itself when a condition holds: weights loaded, nothing left to finish). `check_command`
refuses every commanded move that the table does not list, naming both states.
"""

from __future__ import annotations

import enum
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


class Trigger(enum.Enum):
    COMMAND = "command"
    AUTOMATIC = "automatic"


TRANSITIONS: dict[tuple[ReplicaState, ReplicaState], Trigger] = {
    (S.INACTIVE, S.LOADING_PREFILL): Trigger.COMMAND,
    (S.INACTIVE, S.LOADING_DECODE): Trigger.COMMAND,
    (S.INACTIVE, S.LOADING_ENCODE): Trigger.COMMAND,
    (S.LOADING_PREFILL, S.PREFILL): Trigger.AUTOMATIC,
    (S.LOADING_DECODE, S.DECODE): Trigger.AUTOMATIC,
    (S.LOADING_ENCODE, S.ENCODE): Trigger.AUTOMATIC,
    (S.LOADING_PREFILL, S.NEW_PREFILL): Trigger.COMMAND,
    (S.NEW_PREFILL, S.REFRACTORY_PREFILL): Trigger.AUTOMATIC,
    (S.REFRACTORY_PREFILL, S.PREFILL): Trigger.AUTOMATIC,
    (S.PREFILL, S.OLD_PREFILL): Trigger.COMMAND,
    (S.OLD_PREFILL, S.PREFILL): Trigger.AUTOMATIC,
    (S.PREFILL, S.MUTATING_TO_DECODE): Trigger.COMMAND,
    (S.MUTATING_TO_DECODE, S.DECODE): Trigger.AUTOMATIC,
    (S.PREFILL, S.SHUTTING_PREFILL): Trigger.COMMAND,
    (S.DECODE, S.SHUTTING_DECODE): Trigger.COMMAND,
    (S.ENCODE, S.SHUTTING_ENCODE): Trigger.COMMAND,
    (S.SHUTTING_PREFILL, S.SHUTTING_NULL): Trigger.AUTOMATIC,
    (S.SHUTTING_DECODE, S.SHUTTING_NULL): Trigger.AUTOMATIC,
    (S.SHUTTING_ENCODE, S.SHUTTING_NULL): Trigger.AUTOMATIC,
    (S.SHUTTING_NULL, S.AUS_PREFILL): Trigger.COMMAND,
    (S.SHUTTING_NULL, S.AUS_DECODE): Trigger.COMMAND,
    (S.AUS_PREFILL, S.PREFILL): Trigger.AUTOMATIC,
    (S.AUS_DECODE, S.DECODE): Trigger.AUTOMATIC,
    (S.SHUTTING_NULL, S.INACTIVE): Trigger.COMMAND,
}

# Commands that start ZigZag states (architecture §8): they pair a NewPrefill with an OldPrefill replica.
ZIGZAG_STARTS = frozenset({(S.LOADING_PREFILL, S.NEW_PREFILL), (S.PREFILL, S.OLD_PREFILL)})

# The role a replica serves in each state (None: serves nothing).
SERVING_ROLE: dict[ReplicaState, Role | None] = {
    S.PREFILL: "prefill",
    S.NEW_PREFILL: "prefill",
    S.OLD_PREFILL: "prefill",
    S.REFRACTORY_PREFILL: "prefill",
    S.DECODE: "decode",
    S.ENCODE: "encode",
}

# Where a commanded start of each role leads from Inactive, and where it settles.
LOADING_STATE: dict[Role, ReplicaState] = {
    "prefill": S.LOADING_PREFILL,
    "decode": S.LOADING_DECODE,
    "encode": S.LOADING_ENCODE,
}
SHUTTING_STATE: dict[Role, ReplicaState] = {
    "prefill": S.SHUTTING_PREFILL,
    "decode": S.SHUTTING_DECODE,
    "encode": S.SHUTTING_ENCODE,
}


class TransitionError(Exception):
    """Base class of refused transitions."""

    code: str = "invalid_transition"


@final
class InvalidTransition(TransitionError):
    code = "invalid_transition"


@final
class TransitionNotSupported(TransitionError):
    code = "not_supported"


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
