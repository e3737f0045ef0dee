"""Running one command in a replica's main loop (architecture §6).

The actor answers the commands about the replica itself here — a `Transition` (checked before anything
changes: a refused move leaves the state, the weights' source and the roles as they were), `Lock`,
`Unlock`, `SendWeights`, and the transfer protocol's sender-bound messages, which go to the transfer
session that waits for them — and hands every other command to the run's roles through their command
table (`replicas.actor.commands`), after the checks that need what the actor owns (a `ReserveKV` only in
`Decode`, unlocked).

An outcome is the command's result, or the `CommandRefused` it raised. Any other exception is the
replica's failure: the command's outcome says so (`replica_failed`) and the exception goes on, failing
the run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, assert_never

from messages.commands import (
    AddRelayPartner,
    DropKVHalf,
    Flush,
    Lock,
    Relay,
    RelayHint,
    ReserveKV,
    SendCachedKV,
    SendKVHalf,
    SendWeights,
    Transition,
    Unlock,
    WithdrawEncode,
)
from messages.transfer import Abort, Grant, RequestMoreCache, StatusUpdate
from replicas.actor.pools import EncodePools, LanguagePools
from replicas.actor.transitions import Lifecycle
from replicas.actor.wiring import Run
from replicas.inbox import CommandRefused, Envelope
from replicas.loading.peer_send import send_weights
from replicas.loading.progress import WeightsStatus
from replicas.model import Model
from replicas.settings import ReplicaSettings
from replicas.states import ReplicaState, Role, parse_state
from transport.endpoint import SenderDelivery

S = ReplicaState


def handle(
    envelope: Envelope,
    *,
    run: Run,
    lifecycle: Lifecycle,
    pools: LanguagePools | EncodePools,
    settings: ReplicaSettings,
    model: Model | None,
    weights: WeightsStatus,
    missing: Callable[[ReplicaState], str | None],
    configured: Role,
) -> None:
    """Run `envelope`'s command and set its outcome (see the module docstring). `missing(target)`: why
    the replica's pools cannot serve `target`'s role (None: they can); `configured`: the role it was
    built for."""
    try:
        envelope.result = _dispatch(
            envelope, run, lifecycle, pools, settings, model, weights, missing, configured
        )
    except CommandRefused as exc:
        envelope.error = exc
    except Exception as exc:
        envelope.error = CommandRefused(
            "replica_failed",
            f"{run.mailbox.name} failed handling the {type(envelope.command).__name__} command: "
            f"{type(exc).__name__}: {exc}",
        )
        raise
    finally:
        envelope.done.set()


def _dispatch(
    envelope: Envelope,
    run: Run,
    lifecycle: Lifecycle,
    pools: LanguagePools | EncodePools,
    settings: ReplicaSettings,
    model: Model | None,
    weights: WeightsStatus,
    missing: Callable[[ReplicaState], str | None],
    configured: Role,
) -> Any:
    command, roles, name = envelope.command, run.roles, run.mailbox.name
    match command:
        case Transition(to=to):
            target = parse_state(to)
            state = lifecycle.state
            if target is S.OLD_PREFILL and state is S.OLD_PREFILL and command.paired_with:
                roles.paired(target, command.paired_with)  # one more partner (shared)
                return state
            lifecycle.check_command(target, missing(target), configured)
            weights.commanded(to, command.source, command.chain_from)  # what Loading* loads from
            previous = lifecycle.commanded(target, f"{command.origin} command")
            roles.paired(target, command.paired_with)
            return previous
        case Lock(reason=reason):
            used, total = pools.kv_usage()
            return lifecycle.lock(reason, used, total)
        case Unlock(reason=reason):
            return lifecycle.unlock(reason)
        case SendWeights():
            send_weights(
                run.mailbox, model, pools.weights, run.endpoints.weights, settings.weights_transfer, command
            )
            return None
        case Grant() | RequestMoreCache() | Abort() | StatusUpdate():
            assert envelope.link is not None
            pools.deliver(SenderDelivery(envelope.link, command))
            return None
        case ReserveKV():
            lifecycle.check_reservable()
            return roles.commands.answer(name, lifecycle.state, command)
        case (
            Flush()
            | Relay()
            | AddRelayPartner()
            | RelayHint()
            | SendKVHalf()
            | DropKVHalf()
            | WithdrawEncode()
            | SendCachedKV()
        ):
            return roles.commands.answer(name, lifecycle.state, command)
        case _:
            assert_never(command)
