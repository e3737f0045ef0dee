"""The state table and the transition table of architecture §6."""

import pytest

from replicas.states import (
    ACTIVE_STATES,
    DECODE_STEPS,
    ENCODE_JOBS,
    KEEPS_IMAGE_REQUESTS,
    LOADING_STATE,
    MIGRATES_KV,
    PREFILL_BATCHES,
    REVIVING_STATE,
    SERVING_ROLE,
    SETTLED,
    SHUTTING_STATE,
    STATES,
    TRANSITIONS,
    ZIGZAG,
    ZIGZAG_NEW,
    ZIGZAG_STARTS,
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


def test_the_table_has_a_row_per_state_and_its_automatic_moves_are_the_settling_ones() -> None:
    assert set(STATES) == set(ReplicaState)
    automatic = {move for move, trigger in TRANSITIONS.items() if trigger is Trigger.AUTOMATIC}
    assert automatic == {(s, row.settles_to) for s, row in STATES.items() if row.settles_to is not None}
    # Each automatic move of architecture §6, read from the table.
    assert STATES[S.LOADING_PREFILL].settles_to is S.PREFILL
    assert STATES[S.NEW_PREFILL].settles_to is S.REFRACTORY_PREFILL
    assert STATES[S.REFRACTORY_PREFILL].settles_to is S.PREFILL
    assert STATES[S.OLD_PREFILL].settles_to is S.PREFILL
    assert STATES[S.MUTATING_TO_DECODE].settles_to is S.DECODE
    assert {STATES[s].settles_to for s in SHUTTING_STATE.values()} == {S.SHUTTING_NULL}


def test_the_derived_sets() -> None:
    """Every set the node's parts ask about, derived from the table, names the states §6 and §8 say."""
    assert {s.value for s in ZIGZAG_NEW} == {"NewPrefill", "RefractoryPrefill"}
    assert {s.value for s in ZIGZAG} == {"NewPrefill", "RefractoryPrefill", "OldPrefill"}
    assert {s.value for s in SETTLED} == {"Prefill", "Decode", "Encode"}
    assert {s.value for s in PREFILL_BATCHES} == {"Prefill", "ShuttingPrefill", "OldPrefill"}
    assert {s.value for s in DECODE_STEPS} == {"Decode", "ShuttingDecode", "MutatingToDecode"}
    assert {s.value for s in ENCODE_JOBS} == {"Encode", "ShuttingEncode"}
    assert MIGRATES_KV == PREFILL_BATCHES | ZIGZAG_NEW
    assert {s.value for s in KEEPS_IMAGE_REQUESTS} == {"Prefill", "ShuttingPrefill"}
    assert {role: s.value for role, s in LOADING_STATE.items()} == {
        "prefill": "LoadingPrefill",
        "decode": "LoadingDecode",
        "encode": "LoadingEncode",
    }
    assert {role: s.value for role, s in REVIVING_STATE.items()} == {
        "prefill": "AusPrefill",
        "decode": "AusDecode",
    }
    assert {s.value for s in ACTIVE_STATES["decode"]} == {
        "LoadingDecode",
        "Decode",
        "AusDecode",
        "MutatingToDecode",
    }
    assert {s.value for s in ACTIVE_STATES["encode"]} == {"LoadingEncode", "Encode"}
    assert ACTIVE_STATES["prefill"] == {S.LOADING_PREFILL, S.PREFILL, S.AUS_PREFILL} | ZIGZAG
    assert SERVING_ROLE == {
        S.PREFILL: "prefill",
        S.NEW_PREFILL: "prefill",
        S.OLD_PREFILL: "prefill",
        S.REFRACTORY_PREFILL: "prefill",
        S.DECODE: "decode",
        S.ENCODE: "encode",
    }
    assert {(S.LOADING_PREFILL, S.NEW_PREFILL), (S.PREFILL, S.OLD_PREFILL)} == ZIGZAG_STARTS
