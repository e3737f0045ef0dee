"""The transfer status machine of architecture §5.6, with an explicit transition table.

`Bootstrapping → WaitingForInput → Transferring → Success`, and any non-terminal state → `Failed`.
Between rounds a transfer goes back from `Transferring` to `WaitingForInput` (the seeds' "status may
only grow" lost exactly that). Anything else is a bug and raises `InvalidTransition`.
"""

from __future__ import annotations

from typing import Final, final

from messages.transfer import TransferStatus

_B, _W, _T, _S, _F = (
    TransferStatus.BOOTSTRAPPING,
    TransferStatus.WAITING_FOR_INPUT,
    TransferStatus.TRANSFERRING,
    TransferStatus.SUCCESS,
    TransferStatus.FAILED,
)

TRANSITIONS: Final[dict[TransferStatus, frozenset[TransferStatus]]] = {
    _B: frozenset({_W, _T, _F}),
    _W: frozenset({_T, _F}),
    _T: frozenset({_W, _S, _F}),
    _S: frozenset(),
    _F: frozenset(),
}

TERMINAL: Final = frozenset({_S, _F})


@final
class InvalidTransition(Exception):
    """A status change the table does not allow."""


@final
class StatusMachine:
    """The status of one side of one transfer. Same-state "transitions" are no-ops."""

    __slots__ = ("history", "status", "transfer_id")

    def __init__(self, transfer_id: str) -> None:
        self.transfer_id = transfer_id
        self.status = _B
        self.history: list[TransferStatus] = [_B]

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    def move(self, to: TransferStatus) -> None:
        if to == self.status:
            return
        if to not in TRANSITIONS[self.status]:
            raise InvalidTransition(
                f"transfer {self.transfer_id!r}: {self.status.value} → {to.value} is not allowed"
            )
        self.status = to
        self.history.append(to)
