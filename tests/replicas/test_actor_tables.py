"""The replica actor's two tables: the automatic moves (one row per state that settles, a pure
condition over one `Progress`) and the roles' command handlers (a handler per command type, one
answer for every command a role lacks)."""

from __future__ import annotations

import dataclasses

import pytest

from messages.commands import DropKVHalf, Flush, RelayHint, ReserveKV, SendCachedKV, SendKVHalf
from replicas.actor.commands import ABSENT, ROLE_COMMANDS, CommandTable
from replicas.actor.moves import AUTOMATIC, WAITS_FOR_WEIGHTS, Progress, due
from replicas.inbox import CommandRefused
from replicas.states import LOADING_STATE, STATES, ReplicaState

S = ReplicaState
EVERY_FLAG = [field.name for field in dataclasses.fields(Progress)]
# For each state that settles, a picture of its work in which it moves on.
SETTLED: dict[ReplicaState, Progress] = {
    **{state: Progress(weights_landed=True) for state in WAITS_FOR_WEIGHTS},
    S.REFRACTORY_PREFILL: Progress(),
    S.OLD_PREFILL: Progress(episode_over=True),
    S.MUTATING_TO_DECODE: Progress(),
    S.AUS_PREFILL: Progress(),
    S.AUS_DECODE: Progress(),
    S.SHUTTING_PREFILL: Progress(),
    S.SHUTTING_DECODE: Progress(),
    S.SHUTTING_ENCODE: Progress(),
}
# ... and, for each, the flags any one of which holds it back.
HELD_BY: dict[ReplicaState, tuple[str, ...]] = {
    **{state: ("weights_landed",) for state in WAITS_FOR_WEIGHTS},  # cleared: not landed yet
    S.REFRACTORY_PREFILL: ("zigzag_batches", "busy"),
    S.OLD_PREFILL: ("relay_running", "episode_over"),  # episode_over cleared: a partner is left
    S.MUTATING_TO_DECODE: ("busy", "migrating", "prompts_queued", "preparing"),
    S.AUS_PREFILL: ("preparing",),
    S.AUS_DECODE: ("preparing",),
    S.SHUTTING_PREFILL: ("busy", "prompts_queued", "migrating"),
    S.SHUTTING_DECODE: ("busy", "decoding"),
    S.SHUTTING_ENCODE: ("busy", "encoding"),
}


def test_every_state_that_settles_has_one_row() -> None:
    settles = {state for state, row in STATES.items() if row.settles_to is not None}
    assert set(AUTOMATIC) == settles == set(SETTLED) == set(HELD_BY)
    assert set(LOADING_STATE.values()) | {S.NEW_PREFILL} == WAITS_FOR_WEIGHTS


@pytest.mark.parametrize("state", [s for s in S if s in SETTLED], ids=lambda s: s.value)  # in a fixed order
def test_a_state_moves_to_what_it_settles_to_when_its_condition_holds(state: ReplicaState) -> None:
    moved = due(state, SETTLED[state])
    assert moved is not None and moved[0] is STATES[state].settles_to and moved[1] == AUTOMATIC[state].reason
    for flag in HELD_BY[state]:
        held = dataclasses.replace(SETTLED[state], **{flag: not getattr(SETTLED[state], flag)})
        assert due(state, held) is None, f"{state.value} moved although {flag} is {getattr(held, flag)}"


@pytest.mark.parametrize("state", [s for s in S if s not in AUTOMATIC], ids=lambda s: s.value)
def test_a_state_that_does_not_settle_never_moves_by_itself(state: ReplicaState) -> None:
    for value in (False, True):
        assert due(state, Progress(**dict.fromkeys(EVERY_FLAG, value))) is None


def test_a_role_answers_what_it_registered_and_the_rest_as_every_replica_without_that_part() -> None:
    assert set(ABSENT) == set(ROLE_COMMANDS)
    dropped: list[str] = []
    table = CommandTable().on(DropKVHalf, lambda command: dropped.append(command.request_id) or 3)
    assert table.handled() == {DropKVHalf}
    assert table.answer("prefill-0", S.NEW_PREFILL, DropKVHalf(command_id="c1", request_id="r1")) == 3
    assert dropped == ["r1"]
    assert table.answer("encode-0", S.ENCODE, Flush(command_id="c2")) == 0
    assert table.answer("encode-0", S.ENCODE, RelayHint(command_id="c3", new_prefill="prefill-1")) is None
    with pytest.raises(CommandRefused) as refused:
        table.answer("encode-0", S.ENCODE, SendKVHalf(command_id="c4", request_id="r9", transfer_id="t"))
    assert refused.value.code == "not_found" and "r9" in str(refused.value)
    with pytest.raises(CommandRefused) as refused:
        table.answer("encode-0", S.ENCODE, SendCachedKV(command_id="c5", transfer_id="t", keys=[]))
    assert refused.value.code == "not_found"
    reserve = ReserveKV(
        command_id="c6",
        request_id="r",
        transfer_id="t",
        source_endpoint="p",
        prompt_tokens=1,
        capacity_tokens=1,
    )
    with pytest.raises(CommandRefused) as refused:
        table.answer("encode-0", S.ENCODE, reserve)
    assert refused.value.code == "overloaded" and str(refused.value) == "encode-0 is Encode, not Decode"


def test_a_command_has_one_handler_per_table() -> None:
    table = CommandTable().on(Flush, lambda _: 1)
    with pytest.raises(AssertionError, match="a second handler for Flush"):
        table.on(Flush, lambda _: 2)
