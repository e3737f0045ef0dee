"""The commands a replica's roles answer (architecture §6): a table of handlers per role.

The actor answers the commands about the replica itself — `Transition`, `Lock`, `Unlock`, `SendWeights`,
the transfer protocol's sender-bound messages — and checks what it owns before a role sees a command
(a `ReserveKV` only in `Decode`, unlocked). Every other command is a `RoleCommand`: the roles of one
run register a handler per command type (`CommandTable.on`), and a command their table lacks gets the
answer `ABSENT` gives every replica without that part — nothing to do (a count of 0, or no result), or a
refusal with the control protocol's code. A handler runs in the main loop; it raises `CommandRefused`
to refuse, and any other exception fails the replica.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, TypeVar, final

from messages.commands import (
    AddRelayPartner,
    DropKVHalf,
    Flush,
    Relay,
    RelayHint,
    ReserveKV,
    SendCachedKV,
    SendKVHalf,
    WithdrawEncode,
)
from replicas.inbox import CommandRefused
from replicas.states import ReplicaState

RoleCommand = (
    Flush
    | Relay
    | AddRelayPartner
    | RelayHint
    | SendKVHalf
    | DropKVHalf
    | ReserveKV
    | WithdrawEncode
    | SendCachedKV
)
ROLE_COMMANDS: Final = (
    Flush,
    Relay,
    AddRelayPartner,
    RelayHint,
    SendKVHalf,
    DropKVHalf,
    ReserveKV,
    WithdrawEncode,
    SendCachedKV,
)
C = TypeVar("C", bound=RoleCommand)


def _nothing(name: str, state: ReplicaState, command: RoleCommand) -> None:
    return None


def _none_dropped(name: str, state: ReplicaState, command: RoleCommand) -> int:
    return 0


def _no_batch(name: str, state: ReplicaState, command: RoleCommand) -> None:
    raise CommandRefused("not_found", f"{name} is {state.value}: no batch to relay")


def _no_half(name: str, state: ReplicaState, command: RoleCommand) -> None:
    assert isinstance(command, SendKVHalf)
    raise CommandRefused("not_found", f"{name} holds no KV half of request {command.request_id}")


def _not_decode(name: str, state: ReplicaState, command: RoleCommand) -> None:
    raise CommandRefused("overloaded", f"{name} is {state.value}, not Decode")


def _no_cache(name: str, state: ReplicaState, command: RoleCommand) -> None:
    raise CommandRefused("not_found", f"{name} has no KV cache: it caches no KV")


# The answer of a replica whose roles do not handle a command: (replica, state, command) → result.
ABSENT: Final[dict[type[RoleCommand], Callable[[str, ReplicaState, RoleCommand], Any]]] = {
    Flush: _none_dropped,  # no prefilled requests here
    Relay: _no_batch,
    AddRelayPartner: _nothing,
    RelayHint: _nothing,
    SendKVHalf: _no_half,
    DropKVHalf: _none_dropped,
    ReserveKV: _not_decode,
    WithdrawEncode: _nothing,  # no encode jobs here
    SendCachedKV: _no_cache,
}
assert set(ABSENT) == set(ROLE_COMMANDS)


@final
class CommandTable:
    """The handlers of one run's roles, by command type (see the module docstring). Built once, when the
    roles are; `on` refuses a second handler for one type."""

    def __init__(self) -> None:
        self._handlers: dict[type[Any], Callable[[Any], Any]] = {}

    def on(self, kind: type[C], handler: Callable[[C], Any]) -> CommandTable:
        assert kind in ABSENT, f"{kind.__name__} is not a command for a replica's roles"
        assert kind not in self._handlers, f"a second handler for {kind.__name__}"
        self._handlers[kind] = handler
        return self

    def handled(self) -> frozenset[type[RoleCommand]]:
        return frozenset(self._handlers)

    def answer(self, name: str, state: ReplicaState, command: RoleCommand) -> Any:
        """The outcome of `command` for replica `name` in `state`; raises `CommandRefused` to refuse."""
        handler = self._handlers.get(type(command))
        if handler is None:
            return ABSENT[type(command)](name, state, command)
        return handler(command)
