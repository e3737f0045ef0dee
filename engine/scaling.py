"""The `scale` op: bring the number of replicas serving a role to a target, through the state machine.

Scaling up revives idle replicas first (`ShuttingNull` → `AusPrefill` / `AusDecode`, weights still
resident; those configured for the role before others whose pools can serve it), then starts `Inactive`
replicas configured for the role (`Loading*`), then adds new replicas named `{role}-{n}`. Scaling down
commands the least loaded serving replicas into `Shutting*`: they finish what they hold, admit nothing
new, and end `ShuttingNull`. Every move is a commanded transition of DESIGN §6, logged like any other.

Scale ops run one at a time (`Node.scale_lock`, first come first served): each counts the replicas from
the state the one before it left, so two concurrent `scale decode 2` both answer the same two replicas.
Run side by side, both counted the same serving replicas and the second commanded the first's new
replica (still `Inactive`, the first's command not yet handled) into `Loading*` itself; the first's own
command was then refused (`invalid_transition`) and a larger scale was left half-applied. A scale waits
at most `SCALE_WAIT` seconds for the one before it, then answers `overloaded`. A new replica is listed
only once started (`Node.add_replica`), so the scale's own command is the first it handles; a
`transition` sent to it later is judged from the state that command entered.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from engine.control.errors import RequestFailed
from messages.commands import Transition
from messages.control import ScaleRequest
from messages.control_replies import ScaleResult
from replicas.actor import Replica
from replicas.inbox import CommandRefused, new_command_id
from replicas.states import LOADING_STATE, SHUTTING_STATE, ReplicaState, Role
from replicas.supervisor import ReplicaStartFailed

if TYPE_CHECKING:
    from engine.node import Node

S = ReplicaState
# How long a scale waits for the one before it to finish: as long as a replica gets to answer a command
# (`Replica.ask`). Each of a scale's commands is answered at once (a replica's loop never blocks) or fails
# the scale within that time; one that takes longer is starting many replicas, or a slow transfer endpoint.
SCALE_WAIT = 30.0

ACTIVE_STATES: dict[Role, frozenset[ReplicaState]] = {
    "prefill": frozenset(
        {S.LOADING_PREFILL, S.PREFILL, S.AUS_PREFILL, S.NEW_PREFILL, S.OLD_PREFILL, S.REFRACTORY_PREFILL}
    ),
    "decode": frozenset({S.LOADING_DECODE, S.DECODE, S.AUS_DECODE, S.MUTATING_TO_DECODE}),
    "encode": frozenset({S.LOADING_ENCODE, S.ENCODE}),
}
AUS_STATE: dict[Role, ReplicaState] = {"prefill": S.AUS_PREFILL, "decode": S.AUS_DECODE}


def active(node: Node, role: Role) -> list[Replica]:
    return [r for r in node.services.replicas.values() if r.state in ACTIVE_STATES[role]]


def _load(replica: Replica) -> int:
    work, migration = replica.work.queue_lengths()
    return replica.pools.used_blocks() + work + migration


def _fits(replica: Replica, role: Role) -> bool:
    """Whether `replica`'s pools can serve `role` (encode needs an embedding pool, the others KV)."""
    if role == "encode":
        return replica.role == "encode"
    if role == "prefill" and node_has_vision(replica):
        return replica.pools.emb_pool is not None
    return replica.pools.kv is not None


def node_has_vision(replica: Replica) -> bool:
    return replica.services.host.config.image_token_id is not None


async def scale(node: Node, request: ScaleRequest) -> ScaleResult:
    try:
        with trio.fail_after(SCALE_WAIT):
            await node.scale_lock.acquire()
    except trio.TooSlowError:
        raise RequestFailed(
            "overloaded",
            f"an earlier scale op has not finished within {SCALE_WAIT:g} s; "
            "send this one again once it answers",
        ) from None
    try:
        return await _scale(node, request)
    finally:
        node.scale_lock.release()


async def _scale(node: Node, request: ScaleRequest) -> ScaleResult:
    role: Role = request.role
    target = request.replicas
    serving = active(node, role)
    try:
        if len(serving) < target:
            await _scale_up(node, role, target - len(serving))
        elif len(serving) > target:
            for replica in sorted(serving, key=_load)[: len(serving) - target]:
                if replica.state in (S.PREFILL, S.DECODE, S.ENCODE):
                    await replica.ask(
                        Transition(
                            command_id=new_command_id(), to=SHUTTING_STATE[role].value, origin="planner"
                        )
                    )
    except CommandRefused as exc:
        raise RequestFailed(exc.code, str(exc)) from None  # type: ignore[arg-type]
    except ReplicaStartFailed as exc:
        raise RequestFailed("replica_failed", str(exc)) from None
    return ScaleResult(id=request.id, role=role, target=target, replicas=[r.name for r in active(node, role)])


async def _scale_up(node: Node, role: Role, needed: int) -> None:
    # Replicas configured for the role first: reviving another role's replica changes its role.
    replicas = sorted(node.services.replicas.values(), key=lambda r: r.role != role)
    if role in AUS_STATE:
        for replica in replicas:
            if needed and replica.state is S.SHUTTING_NULL and _fits(replica, role):
                await replica.ask(
                    Transition(command_id=new_command_id(), to=AUS_STATE[role].value, origin="planner")
                )
                needed -= 1
    for replica in replicas:
        if not needed or replica.role != role:
            continue
        if replica.state is S.SHUTTING_NULL and role not in AUS_STATE:
            # A role without an Aus state (encode) comes back through Inactive, loading its weights again;
            # adding a new replica instead left the idle one holding its pools for good.
            await replica.ask(Transition(command_id=new_command_id(), to=S.INACTIVE.value, origin="planner"))
        if replica.state is S.INACTIVE:
            await replica.ask(
                Transition(command_id=new_command_id(), to=LOADING_STATE[role].value, origin="planner")
            )
            needed -= 1
    while needed:
        replica = await node.add_replica(role)
        await replica.ask(
            Transition(command_id=new_command_id(), to=LOADING_STATE[role].value, origin="planner")
        )
        needed -= 1
