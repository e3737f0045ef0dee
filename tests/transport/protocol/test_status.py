"""The transfer status machine follows its explicit table."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from messages.transfer import FailureReason, TransferReport, TransferStatus
from transport.errors import ERROR_CODES, TransferFailed, TransferTimeout, transfer_error
from transport.protocol.status import TERMINAL, TRANSITIONS, InvalidTransition, StatusMachine

B, W, T, S, F = (
    TransferStatus.BOOTSTRAPPING,
    TransferStatus.WAITING_FOR_INPUT,
    TransferStatus.TRANSFERRING,
    TransferStatus.SUCCESS,
    TransferStatus.FAILED,
)


def test_the_happy_path_and_back_to_waiting_between_rounds() -> None:
    machine = StatusMachine("t1")
    for status in (W, T, W, T, S):
        machine.move(status)
    assert machine.history == [B, W, T, W, T, S]
    assert machine.terminal


@pytest.mark.parametrize("start", [B, W, T])
def test_any_non_terminal_state_may_fail(start: TransferStatus) -> None:
    assert F in TRANSITIONS[start]


def test_refused_transitions_name_both_states() -> None:
    machine = StatusMachine("t7")
    with pytest.raises(InvalidTransition, match=r"^transfer 't7': bootstrapping → success is not allowed$"):
        machine.move(S)
    machine.move(F)
    with pytest.raises(InvalidTransition, match=r"failed → transferring is not allowed"):
        machine.move(T)


@given(moves=st.lists(st.sampled_from(list(TransferStatus)), max_size=12))
def test_random_moves_obey_the_table(moves: list[TransferStatus]) -> None:
    machine = StatusMachine("t")
    for target in moves:
        before = machine.status
        allowed = target == before or target in TRANSITIONS[before]
        if allowed:
            machine.move(target)
            assert machine.status == target
        else:
            with pytest.raises(InvalidTransition):
                machine.move(target)
            assert machine.status == before
    assert all(not TRANSITIONS[status] for status in TERMINAL)


def test_failure_reasons_map_to_exact_exceptions_and_codes() -> None:
    assert set(ERROR_CODES) == set(FailureReason)
    for reason in FailureReason:
        report = TransferReport(
            transfer_id="t",
            role="receiver",
            peer="p",
            status=F,
            rounds=0,
            grants=1,
            tokens=0,
            bytes=0,
            seconds=0.0,
            started_at=0.0,
            ended_at=0.0,
            reason=reason,
            detail="why",
        )
        error = transfer_error(report)
        expected = TransferTimeout if reason is FailureReason.MEMORY_PRESSURE else TransferFailed
        assert type(error) is expected
        assert error.code == ("transfer_timeout" if expected is TransferTimeout else "transfer_failed")
        assert str(error) == f"transfer 't' failed ({reason.value}): why"
