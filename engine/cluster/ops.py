"""Control ops that reach past one node: served elsewhere and relayed (`ClientOp`), and the cluster's
view in `status`.

A node asked to `cancel` a request it did not admit asks every other node; a `scale` naming another
node, or finding no free replica slot here, runs on that node; `shutdown {"cluster": true}` asks every
other node to shut down, then this one. The op runs there as if a client had sent it to that node's
control socket; its final reply comes back as JSON and is sent to this node's client under its own id.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Final, Protocol, TypeVar, final

import msgspec
import structlog

from engine.cluster.membership import Membership
from engine.cluster.peers import PeerLinks, PeerUnreachable, new_correlation
from engine.control.errors import RequestFailed
from engine.control.outbox import ConnectionInfo, Outbox, ReplySink
from messages.cluster import ClientOp, ClientOpResult, Report
from messages.control import ControlRequest, MetricsRequest
from messages.control_replies import (
    ClusterTotals,
    ErrorReply,
    MetricsResult,
    ReplicaStatus,
    RequestCounters,
    TokenCounters,
)

_log = structlog.get_logger("engine.cluster")
FORWARD_TIMEOUT: Final = 60.0
R = TypeVar("R")
S = TypeVar("S", RequestCounters, TokenCounters)
Handle = Callable[[ControlRequest, ReplySink], Awaitable[None]]  # a node's control handler


class ForwardingNode(Protocol):
    """What forwarding control ops to other nodes needs of this node (its cluster member,
    `engine.cluster.member`): its id, links and membership, its free replica slots and the others'
    last reports."""

    @property
    def node_id(self) -> str: ...

    @property
    def peers(self) -> PeerLinks: ...

    @property
    def membership(self) -> Membership: ...

    @property
    def replica_slots(self) -> int:
        """Replica slots still free on this node."""
        ...

    @property
    def reported(self) -> Mapping[str, Report]: ...

    def other_nodes(self) -> list[str]: ...


@final
class ClusterOps:
    """See the module docstring."""

    def __init__(self, member: ForwardingNode, handle: Handle) -> None:
        self.member = member
        self._handle = handle  # the node's control handler

    async def serve_forwarded(self, sender: str, message: ClientOp) -> None:
        """Run a forwarded op here and answer with its final reply (an error reply when it failed)."""
        outbox = Outbox(max_replies=16)
        sink = ReplySink(
            message.request, outbox, ConnectionInfo(connection="peer", peer=sender), lambda: None
        )
        try:
            await self._handle(message.request, sink)
        except RequestFailed as exc:
            outbox.put(ErrorReply(id=message.request.id, code=exc.code, message=exc.message), final=True)
        outbox.finish()
        lines: list[bytes] = []
        while (chunk := await outbox.next_chunk()) is not None:
            lines.extend(line for line in chunk.split(b"\n") if line)
        reply = (
            lines[-1]
            if lines
            else msgspec.json.encode(
                ErrorReply(id=message.request.id, code="internal", message="the op sent no reply")
            )
        )
        self.member.peers.send(sender, ClientOpResult(correlation=message.correlation, reply=reply))

    async def forward(self, node: str, request: ControlRequest, result_type: type[R]) -> R:
        """Run `request` on `node`; its result, or `RequestFailed` with the error it got there."""
        member = self.member
        correlation = new_correlation(member.node_id)
        try:
            answer = await member.peers.ask(
                node, ClientOp(correlation=correlation, request=request), correlation, timeout=FORWARD_TIMEOUT
            )
        except PeerUnreachable as exc:
            raise RequestFailed("replica_failed", str(exc)) from None
        assert isinstance(answer, ClientOpResult)
        reply = msgspec.json.decode(answer.reply, type=ErrorReply | result_type)
        if isinstance(reply, ErrorReply):
            raise RequestFailed(reply.code, f"node {node}: {reply.message}")
        return reply

    async def cancel_elsewhere(self, request: ControlRequest, result_type: type[R]) -> R | None:
        """Ask every other node to cancel; the first that had the request answers."""
        for node in self.member.other_nodes():
            try:
                return await self.forward(node, request, result_type)
            except RequestFailed as exc:
                if exc.code != "not_found":
                    _log.info("cluster.cancel_forward_failed", node=node, error=exc.message)
        return None

    async def shutdown_others(self, request: ControlRequest, result_type: type[R]) -> list[str]:
        stopped = []
        for node in self.member.other_nodes():
            try:
                await self.forward(node, request, result_type)
                stopped.append(node)
            except RequestFailed as exc:
                _log.warning("cluster.shutdown_forward_failed", node=node, error=exc.message)
        return stopped

    def place(self, wanted: str | None) -> str:
        """The node a `scale` runs on: `wanted`, else this one while it has a free replica slot, else the
        member with the most free slots."""
        member = self.member
        members = member.membership.members
        if wanted is not None:
            if wanted not in members:
                known = ", ".join(sorted(members))
                raise RequestFailed("not_found", f"no node {wanted!r} in the cluster; nodes are {known}")
            return wanted
        slots = member.replica_slots
        if slots > 0 or len(members) == 1:
            return member.node_id
        best = max(members.values(), key=lambda r: r.capacity.free_replica_slots)
        return best.node_id if best.capacity.free_replica_slots > 0 else member.node_id

    async def totals(self, mine: MetricsResult) -> ClusterTotals:
        """The leader's cluster totals: `mine` plus every other member's counters (asked now)."""
        results, missing = [mine], []
        for node in self.member.other_nodes():
            try:
                results.append(await self.forward(node, MetricsRequest(id=mine.id), MetricsResult))
            except RequestFailed as exc:
                _log.info("cluster.metrics_forward_failed", node=node, error=exc.message)
                missing.append(node)
        errors: Counter[str] = Counter()
        for result in results:
            errors.update(result.errors)

        def total(kind: type[S], get: Callable[[MetricsResult], S]) -> S:
            return kind(**{f: sum(getattr(get(r), f) for r in results) for f in kind.__struct_fields__})

        return ClusterTotals(
            nodes=[self.member.node_id, *[n for n in self.member.other_nodes() if n not in missing]],
            missing=missing,
            requests=total(RequestCounters, lambda r: r.requests),
            tokens=total(TokenCounters, lambda r: r.tokens),
            errors=dict(errors),  # type: ignore[arg-type]
        )

    def statuses(self) -> list[ReplicaStatus]:
        """The other nodes' replicas as they last reported them."""
        return [r.status for _, report in sorted(self.member.reported.items()) for r in report.replicas]
