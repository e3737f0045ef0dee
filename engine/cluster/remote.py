"""A replica of another node, as this node sees it: its last report, and commands sent over a peer link.

`RemoteReplica` is what the router, the migrator and the controller use for a replica that lives in
another process. Its state is the one its node last reported (`messages.cluster.Report`, on every change
and at least every `REPORT_HEARTBEAT` seconds); `ask` runs a command there and waits for the outcome,
as `Replica.ask` does locally, raising the same `CommandRefused`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, final

from messages.cluster import ReplicaReport
from messages.commands import ReplicaCommand
from messages.log.events import ReplicaBlocks
from replicas.inbox import CommandRefused
from replicas.states import ReplicaState, parse_state

if TYPE_CHECKING:
    from engine.cluster.member import ClusterMember


@final
class RemoteReplica:
    """See the module docstring. `name` is cluster-unique (`{node}/{role}-{index}`)."""

    def __init__(self, member: ClusterMember, node: str, report: ReplicaReport) -> None:
        self.member = member
        self.node = node
        self.report = report
        # Prompt tokens this node sent it since its last report (the router's estimate of its queue).
        self.submitted_tokens = 0

    def update(self, report: ReplicaReport) -> None:
        self.report = report
        self.submitted_tokens = 0

    @property
    def name(self) -> str:
        return self.report.status.name

    @property
    def role(self) -> str:
        return self.report.role

    @property
    def state(self) -> ReplicaState:
        return parse_state(self.report.status.state)

    @property
    def lock_reasons(self) -> frozenset[str]:
        return frozenset(self.report.status.lock_reasons)

    def kv_usage(self) -> tuple[int, int]:
        return self.report.status.cached_blocks, self.report.kv_total

    def blocks(self) -> ReplicaBlocks:
        """The replica's blocks as its node last reported them (the leader's block report)."""
        r = self.report.status
        return ReplicaBlocks(
            replica=r.name,
            state=r.state,
            used_blocks=r.used_blocks,
            cached_blocks=r.cached_blocks,
            total_blocks=r.total_blocks,
            locked=r.locked,
        )

    @property
    def queued_tokens(self) -> int:
        return self.report.queued_prompt_tokens + self.submitted_tokens

    async def ask(self, command: ReplicaCommand, *, timeout: float = 30.0) -> Any:
        """Run `command` on the replica's node; raises `CommandRefused` (`replica_failed` when its node
        does not answer within `timeout`)."""
        return await self.member.run_command(self, command, timeout=timeout)

    def submit(self, request: Any) -> bool:
        """Send `request` (a `ServingRequest`) to this replica's queue; the node answers `Returned`
        when the replica does not take it. False when this node cannot reach the cluster now."""
        return self.member.submit(self, request)

    def refused(self, why: str) -> CommandRefused:
        return CommandRefused("replica_failed", f"{self.name} (node {self.node}): {why}")
