"""Replica commands between nodes: `RemoteReplica.ask` on one side, `RunCommand` served on the other.

A `ReserveKV` carries the request it reserves for (`RequestSnapshot`): the decode node adopts it as a
mirror, and once the reservation holds, the origin learns which replica holds the request (`Holding`,
or directly when the origin asked). Commands that act on a reservation or a lock (`ReserveKV`, `Lock`,
`Unlock`) from a node whose lease is not its current one are refused with `stale_lease`.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from engine.cluster.books.requests import RequestBooks
from engine.cluster.membership import Membership
from engine.cluster.peers import PeerLinks, PeerUnreachable, new_correlation
from engine.cluster.remote import RemoteReplica
from engine.cluster.requests import snapshot
from messages.cluster import CommandOutcome, PeerFrame, RunCommand
from messages.commands import Lock, Relay, RelayOffer, ReplicaCommand, ReserveKV, Unlock
from replicas.actor import Replica
from replicas.directory import ReplicaDirectory
from replicas.fabric import Fabric, UnknownEndpoint
from replicas.inbox import CommandRefused
from replicas.states import ReplicaState


class CommandNode(Protocol):
    """What running replica commands between nodes needs of this node (its cluster member,
    `engine.cluster.member`): its id, links and membership, its replicas and transfer endpoints, and the
    books of the requests that cross nodes."""

    @property
    def node_id(self) -> str: ...

    @property
    def directory(self) -> ReplicaDirectory: ...

    @property
    def fabric(self) -> Fabric: ...

    @property
    def peers(self) -> PeerLinks: ...

    @property
    def membership(self) -> Membership: ...

    @property
    def books(self) -> RequestBooks: ...

    @property
    def reachable(self) -> bool: ...


LEASED = (ReserveKV, Lock, Unlock)  # commands refused from a stale lease


async def run_command(
    member: CommandNode, replica: RemoteReplica, command: ReplicaCommand, *, timeout: float
) -> Any:
    """`RemoteReplica.ask`: a `ReserveKV` carries the request (this node's object of it)."""
    if not member.reachable:
        raise replica.refused("this node cannot reach the cluster's etcd now (cluster degraded)")
    books = member.books
    snap = None
    if isinstance(command, ReserveKV):
        request = books.live(command.request_id)
        if request is None or request.ended:
            raise CommandRefused("not_found", f"request {command.request_id} is not live here")
        books.track(request)  # its cancel reaches the decode node while the reservation is asked
        snap = snapshot(request, books.origin_of(request), images=False)
    correlation = new_correlation(member.node_id)
    message = RunCommand(correlation=correlation, replica=replica.name, command=command, request=snap)
    try:
        outcome = await member.peers.ask(replica.node, message, correlation, timeout=timeout)
    except PeerUnreachable as exc:
        raise replica.refused(str(exc)) from None
    assert isinstance(outcome, CommandOutcome)
    if outcome.error_code is not None:
        raise CommandRefused(outcome.error_code, outcome.error_message or "refused")
    if isinstance(command, ReserveKV):  # the remote decode replica holds the request now
        request = books.live(command.request_id)
        if request is not None:
            request.hand_to(replica.name)
            books.held_at(request, replica.node)
    if isinstance(command, Relay):
        return _take_relay(member, command, outcome)
    return outcome.result


def _take_relay(member: CommandNode, command: Relay, outcome: CommandOutcome) -> RelayOffer:
    """A batch another node's NewPrefill replica handed over (ZigZag across nodes): its requests are
    adopted here, held by the asking OldPrefill replica (their origin hears of it, `Holding`); one that
    ended meanwhile is left out of the adoption, and the OldPrefill replica skips it."""
    if outcome.relay is None:
        raise CommandRefused("internal", f"the answer to a relay ask of {command.old_prefill} held no offer")
    for snap in outcome.requests:
        request = member.books.adopt(snap)
        if request is not None:
            request.hand_to(command.old_prefill)
            member.books.now_holding(snap.request_id, command.old_prefill)
    return outcome.relay


async def serve_command(member: CommandNode, frame: PeerFrame, message: RunCommand) -> None:
    """Run a `RunCommand` from `frame.sender` here and answer with its `CommandOutcome`."""
    command = message.command
    books = member.books
    created = message.request is not None and books.live(message.request.request_id) is None
    try:
        replica = _command_target(member, frame, message)
        result = await replica.ask(command)
        if isinstance(result, RelayOffer):
            outcome = _relay_outcome(member, frame, message.correlation, result)
        else:
            plain = msgspec.to_builtins(result.value if isinstance(result, ReplicaState) else result)
            outcome = CommandOutcome(correlation=message.correlation, result=plain)
        if isinstance(command, ReserveKV):
            # The KV starts to move now: stamped here, beside the landing's stamp (one clock).
            request = books.live(command.request_id)
            if request is not None:
                request.stamp_first("kv_started")
            books.now_holding(command.request_id, replica.name)
    except CommandRefused as exc:
        outcome = CommandOutcome(
            correlation=message.correlation,
            error_code=exc.code,
            error_message=str(exc),
        )
        if created and message.request is not None:
            books.drop_mirror(message.request.request_id)
    member.peers.send(frame.sender, outcome)


def _command_target(member: CommandNode, frame: PeerFrame, message: RunCommand) -> Replica:
    """The replica a `RunCommand` names, its request adopted; raises `CommandRefused`."""
    sender = member.membership.members.get(frame.sender)
    if isinstance(message.command, LEASED) and (sender is None or sender.lease != frame.lease):
        raise CommandRefused(
            "stale_lease",
            f"{type(message.command).__name__} from node {frame.sender} under lease {frame.lease:x}, "
            "which is not its current one",
        )
    replica = member.directory.get(message.replica)
    if replica is None:
        raise CommandRefused("not_found", f"no replica {message.replica!r} on node {member.node_id}")
    if isinstance(message.command, ReserveKV):
        try:
            member.fabric.address(message.command.source_endpoint)
        except UnknownEndpoint:
            # A node known afresh (a new lease) whose first report has not come yet: its endpoints'
            # addresses come with it. Refused, so the sender asks another replica or again shortly.
            raise CommandRefused(
                "overloaded",
                f"node {member.node_id} has no address for {message.command.source_endpoint} yet "
                f"(no report from node {frame.sender} since it joined)",
            ) from None
    if message.request is not None and member.books.adopt(message.request) is None:
        raise CommandRefused("not_found", f"request {message.request.request_id} has ended")
    return replica


def _relay_outcome(
    member: CommandNode, frame: PeerFrame, correlation: str, offer: RelayOffer
) -> CommandOutcome:
    """The answer to a `Relay` from another node's OldPrefill replica: the offer and its requests as
    they are now. The node that asked holds them from here on: a request this node is the origin of
    fails when that node leaves (`RequestBooks.held_at`), as for a decode replica's `ReserveKV`."""
    books = member.books
    snaps = []
    for relayed in offer.requests:
        request = books.live(relayed.request_id)
        if request is None or request.ended:
            continue
        books.held_at(request, frame.sender)
        snaps.append(snapshot(request, books.origin_of(request), images=False))
    return CommandOutcome(correlation=correlation, relay=offer, requests=snaps)
