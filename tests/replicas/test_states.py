"""The transition table of architecture §6."""

import pytest

from replicas.states import (
    TRANSITIONS,
    InvalidTransition,
    ReplicaState,
    Trigger,
    check_command,
    parse_state,
)

S = ReplicaState


def test_every_commanded_move_in_the_table_is_accepted() -> None:
    for (current, target), trigger in TRANSITIONS.items():
        if trigger is Trigger.COMMAND and (current, target) not in {
            (S.LOADING_PREFILL, S.NEW_PREFILL),
            (S.PREFILL, S.OLD_PREFILL),
        }:
            check_command("r-0", current, target)


def test_illegal_move_names_both_states() -> None:
    with pytest.raises(
        InvalidTransition,
        match=r"^decode-0: cannot move from Decode to Prefill; from Decode you can command: ShuttingDecode$",
    ):
        check_command("decode-0", S.DECODE, S.PREFILL)


def test_automatic_move_cannot_be_commanded() -> None:
    with pytest.raises(
        InvalidTransition, match=r"from ShuttingDecode to ShuttingNull \(that move happens automatically\)"
    ):
        check_command("decode-0", S.SHUTTING_DECODE, S.SHUTTING_NULL)


def test_zigzag_starts_are_commanded_moves() -> None:
    check_command("prefill-0", S.PREFILL, S.OLD_PREFILL)
    check_command("prefill-1", S.LOADING_PREFILL, S.NEW_PREFILL)
    with pytest.raises(InvalidTransition, match=r"^prefill-1: cannot move from NewPrefill to Prefill"):
        check_command("prefill-1", S.NEW_PREFILL, S.PREFILL)


def test_every_state_but_the_dead_ends_is_reachable_from_inactive() -> None:
    reached = {S.INACTIVE}
    frontier = [S.INACTIVE]
    while frontier:
        current = frontier.pop()
        for frm, to in TRANSITIONS:
            if frm is current and to not in reached:
                reached.add(to)
                frontier.append(to)
    assert reached == set(ReplicaState)


def test_parse_state_lists_valid_names() -> None:
    assert parse_state("MutatingToDecode") is S.MUTATING_TO_DECODE
    with pytest.raises(ValueError, match=r"unknown replica state 'Prefil'; valid states: Inactive, "):
        parse_state("Prefil")
