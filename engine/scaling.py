"""The `scale` op: bring the number of replicas serving a role to a target, through the state machine.

Scaling up revives idle replicas first (`ShuttingNull` → `AusPrefill` / `AusDecode`, weights still
resident; those configured for the role before others whose pools can serve it), then starts `Inactive`
replicas configured for the role (`Loading*`), then adds new replicas named `{role}-{n}`. Scaling down
commands the least loaded serving replicas into `Shutting*`: they finish what they hold, admit nothing
new, and end `ShuttingNull`. Every move is a commanded transition of architecture §6, logged like any other.

Scale ops run one at a time (`NodeCore.scale_lock`, first come first served): each counts the replicas from
the state the one before it left, so two concurrent `scale decode 2` both answer the same two replicas.
Run side by side, both counted the same serving replicas and the second commanded the first's new
replica (still `Inactive`, the first's command not yet handled) into `Loading*` itself; the first's own
command was then refused (`invalid_transition`) and a larger scale was left half-applied. A scale waits
at most `SCALE_WAIT` seconds for the one before it, then answers `overloaded`. A new replica is listed
only once started (`NodeCore.add_replica`), so the scale's own command is the first it handles; a
`transition` sent to it later is judged from the state that command entered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import final

import trio

from engine.control.errors import RequestFailed
from engine.core import NodeCore
from messages.commands import Origin, Transition
from messages.control import ScaleMode, ScaleRequest, SourceChoice, WeightsSource
from messages.control_replies import ScaleResult, StartedReplica
from messages.log.scaling import ReplicasPaired
from replicas.actor import Replica
from replicas.actor.supervisor import ReplicaStartFailed
from replicas.inbox import CommandRefused, new_command_id
from replicas.loading.copy import choose_peer
from replicas.ports import PeerReplica, peer_named
from replicas.states import (
    ACTIVE_STATES,
    LOADING_STATE,
    PAIRABLE,
    REVIVING_STATE,
    SETTLED,
    SHUTTING_STATE,
    STATES,
    ZIGZAG,
    ZIGZAG_OLD,
    ReplicaState,
    Role,
)

S = ReplicaState
# How long a scale waits for the one before it to finish: as long as a replica gets to answer a command
# (`Replica.ask`). Each of a scale's commands is answered at once (a replica's loop never blocks) or fails
# the scale within that time; one that takes longer is starting many replicas, or a slow transfer endpoint.
SCALE_WAIT = 30.0


def active(node: NodeCore, role: Role) -> list[Replica]:
    return [r for r in node.directory.local() if r.state in ACTIVE_STATES[role]]


def _load(replica: PeerReplica) -> int:
    return replica.snapshot().load


def _fits(node: NodeCore, replica: Replica, role: Role) -> bool:
    """Whether `replica`'s pools can serve `role` (encode needs an embedding pool, the others KV)."""
    snap = replica.snapshot()
    if role == "encode":
        return snap.role == "encode"
    if role == "prefill" and node.host.config.image_token_id is not None:
        return snap.embedding_pool
    return snap.kv_blocks > 0


async def scale(node: NodeCore, request: ScaleRequest, *, origin: Origin = "manual") -> ScaleResult:
    """Apply `request` (see the module docstring); `origin` says who asked — the `scale` op (`manual`) or
    the planner — in every transition it commands, as the replicas log them."""
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
        return await _scale(node, request, origin)
    finally:
        node.scale_lock.release()


async def _scale(node: NodeCore, request: ScaleRequest, origin: Origin) -> ScaleResult:
    role: Role = request.role
    target = request.replicas
    serving = active(node, role)
    mode = request.mode
    if mode == "zigzag" and role != "prefill":
        raise RequestFailed("bad_request", f"mode zigzag scales prefill only; {role} loads stop_the_world")
    if mode is None:
        zigzag = role == "prefill" and any(r.state is S.PREFILL for r in serving)
        mode = "zigzag" if zigzag else "stop_the_world"
    if mode == "zigzag" and len(serving) < target:
        partners(node, request.partner)  # raises `bad_request` when no replica can be the partner
    started: list[StartedReplica] = []
    try:
        if len(serving) < target:
            steps = _Steps(mode, request.source, request.partner, origin)
            await _scale_up(node, role, target - len(serving), steps, started)
        elif len(serving) > target:
            await _wait_for_episode(node, role)
            for replica in sorted(active(node, role), key=_load)[: len(serving) - target]:
                if replica.state in SETTLED:
                    await replica.ask(
                        Transition(command_id=new_command_id(), to=SHUTTING_STATE[role].value, origin=origin)
                    )
    except CommandRefused as exc:
        raise RequestFailed(exc.code, str(exc)) from None
    except ReplicaStartFailed as exc:
        raise RequestFailed("replica_failed", str(exc)) from None
    return ScaleResult(
        id=request.id,
        role=role,
        target=target,
        replicas=[r.name for r in active(node, role)],
        started=started,
    )


def episode(node: NodeCore, role: Role) -> list[Replica]:
    """Replicas of `role` in a ZigZag episode (NewPrefill, RefractoryPrefill, OldPrefill)."""
    if role != "prefill":
        return []
    return [r for r in node.directory.local() if r.state in ZIGZAG]


async def _wait_for_episode(node: NodeCore, role: Role) -> None:
    """A scale-down waits (bounded) for a ZigZag episode to end: its replicas are not serving plainly.
    Every replica's state change is a node-wide change (`NodeCore.changes`), so it looks again at each."""
    await node.changes.wait_until(lambda: not episode(node, role), timeout=SCALE_WAIT)
    busy = episode(node, role)
    if busy:
        states = ", ".join(f"{r.name} {r.state.value}" for r in busy)
        raise RequestFailed(
            "overloaded",
            f"a ZigZag episode is still running after {SCALE_WAIT:g} s ({states}); scale down once it ends",
        )


@final
@dataclass(frozen=True, slots=True)
class _Steps:
    """How a scale-up starts each replica: the mode, the weights' source, the ZigZag partner, who asked."""

    mode: ScaleMode
    source: SourceChoice
    partner: str
    origin: Origin


async def _scale_up(
    node: NodeCore, role: Role, needed: int, steps: _Steps, started: list[StartedReplica]
) -> None:
    # Replicas configured for the role first: reviving another role's replica changes its role.
    replicas = sorted(node.directory.local(), key=lambda r: r.role != role)
    chain: list[str] = []  # the replicas this scale started copying from a peer, in order
    if role in REVIVING_STATE:
        for replica in replicas:
            if needed and replica.state is S.SHUTTING_NULL and _fits(node, replica, role):
                await replica.ask(
                    Transition(
                        command_id=new_command_id(), to=REVIVING_STATE[role].value, origin=steps.origin
                    )
                )
                started.append(StartedReplica(replica=replica.name, mode=steps.mode, source="resident"))
                needed -= 1
    for replica in replicas:
        if not needed or replica.role != role:
            continue
        if replica.state is S.SHUTTING_NULL and role not in REVIVING_STATE:
            # A role without an Aus state (encode) comes back through Inactive, loading its weights again;
            # adding a new replica instead left the idle one holding its pools for good.
            await replica.ask(
                Transition(command_id=new_command_id(), to=S.INACTIVE.value, origin=steps.origin)
            )
        if replica.state is S.INACTIVE:
            await _start(node, replica, role, steps, started, chain)
            needed -= 1
    while needed:
        replica = await node.add_replica(role)
        await _start(node, replica, role, steps, started, chain)
        needed -= 1


async def _start(
    node: NodeCore,
    replica: Replica,
    role: Role,
    steps: _Steps,
    started: list[StartedReplica],
    chain: list[str],
) -> None:
    """Command `replica` into Loading*; with ZigZag, straight on into NewPrefill, paired. Replicas one
    scale starts from a peer form a multicast chain (`chain`, in order): each copies every piece from
    the one before it as soon as it landed there, the first from the peer (docs/weights.md)."""
    planned = planned_source(node, replica, steps.source)
    chain_from = chain[-1] if planned == "peer" and chain else None
    await replica.ask(
        Transition(
            command_id=new_command_id(),
            to=LOADING_STATE[role].value,
            origin=steps.origin,
            source=steps.source,
            chain_from=chain_from,
        )
    )
    if planned == "peer":
        chain.append(replica.name)
    if steps.mode == "zigzag" and replica.state is S.LOADING_PREFILL:
        await pair(node, replica, choose_old_prefill(node, steps.partner), origin=steps.origin)
    started.append(StartedReplica(replica=replica.name, mode=steps.mode, source=planned))


def planned_source(node: NodeCore, replica: Replica, source: SourceChoice) -> WeightsSource:
    """The source a copy starts from: `auto` is a peer holding the model, else the host copy, else disk
    (the copy may still fall back mid-way: its events and `status` say where the weights came from)."""
    if source != "auto":
        return source
    if choose_peer(node.directory, node.fabric, replica.name) is not None:
        return "peer"
    return "host" if node.host.host_copy is not None else "disk"


def partners(node: NodeCore, partner: str = "auto") -> list[PeerReplica]:
    """The replicas a new NewPrefill may pair with, best first: with `partner` a replica's name, that
    replica (this node's or another's), which must be in `Prefill` or `OldPrefill`; with `auto`, this
    node's, then the other nodes' as last reported — in each, the `Prefill` replicas (not yet paired)
    least loaded first, then the `OldPrefill` ones (partners are shared when there are not enough).
    Raises `RequestFailed` (`bad_request`) when there is none."""
    if partner != "auto":
        named = peer_named(node.directory, partner)
        if named is None or named.state not in PAIRABLE:
            state = "not known" if named is None else f"{named.state.value}"
            raise RequestFailed(
                "bad_request",
                f"partner {partner!r} is {state}; a ZigZag partner is a Prefill or OldPrefill replica",
            )
        return [named]

    found = _pairable(node)
    if not found:
        raise RequestFailed(
            "bad_request",
            "mode zigzag needs a Prefill or OldPrefill replica to pair with, of this node or another; "
            "there is none",
        )
    return found


def _pairable(node: NodeCore) -> list[PeerReplica]:
    """`partners`' `auto` order (possibly empty)."""

    def ranked(replicas: Sequence[PeerReplica]) -> list[PeerReplica]:
        """Serving plainly before already paired, then the least loaded first."""
        found = (r for r in replicas if r.state in PAIRABLE)
        return sorted(found, key=lambda r: (r.state in ZIGZAG_OLD, _load(r)))

    return ranked(node.directory.local()) + ranked(node.directory.remote())


def choose_old_prefill(node: NodeCore, partner: str = "auto") -> PeerReplica:
    """The partner for a new NewPrefill (`partners`' first)."""
    return partners(node, partner)[0]


async def pair(
    node: NodeCore, new: Replica, old: PeerReplica | None, *, origin: Origin = "manual"
) -> PeerReplica | None:
    """Move `new` (LoadingPrefill) into NewPrefill and `old` (Prefill, or an OldPrefill that takes one
    more partner; of this node or another) into OldPrefill, each naming the other. Returns the partner,
    or None when `new` finished loading before it could be paired (it then serves as a plain Prefill
    replica). Raises `RequestFailed` when no replica can be the partner, `CommandRefused` when one
    refuses (a partner on another node: also when its node does not answer)."""
    if old is None:
        found = _pairable(node)
        if not found:
            raise RequestFailed("bad_request", f"{new.name}: no Prefill or OldPrefill replica to pair with")
        old = found[0]
    try:
        await new.ask(
            Transition(
                command_id=new_command_id(), to=S.NEW_PREFILL.value, origin=origin, paired_with=old.name
            )
        )
    except CommandRefused:
        loading = LOADING_STATE["prefill"]
        if new.state in (loading, STATES[loading].settles_to):
            return None  # it finished loading first: nothing to relay, it serves as a Prefill replica
        raise
    await old.ask(
        Transition(command_id=new_command_id(), to=S.OLD_PREFILL.value, origin=origin, paired_with=new.name)
    )
    node.log.bind(replica=new.name).emit(ReplicasPaired(new_prefill=new.name, old_prefill=old.name))
    return old
