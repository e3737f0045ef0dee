"""A replica of another node, as this node sees it: its last report, and commands sent over a peer link.

`RemoteReplica` is what the router, the migrator and the controller use for a replica that lives in
another process (a `replicas.ports.PeerReplica`, as a local replica is). Its snapshot is built from what
its node last reported (`messages.cluster.Report`, on every change and at least every `REPORT_HEARTBEAT`
seconds) and the prompt tokens this node sent it since; `ask` runs a command there and waits for the
outcome, as `Replica.ask` does locally, raising the same `CommandRefused`. It reaches its node through
its `Courier` (the member).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, final

from messages.cluster import PrefixDelta, ReplicaReport
from messages.commands import ReplicaCommand
from replicas.inbox import CommandRefused
from replicas.request import ServingRequest
from replicas.snapshot import ReplicaSnapshot
from replicas.states import ReplicaState, Role, parse_state


class Courier(Protocol):
    """How a remote replica reaches its node (the cluster member)."""

    async def run_command(
        self, replica: RemoteReplica, command: ReplicaCommand, *, timeout: float
    ) -> Any: ...

    def submit(self, replica: RemoteReplica, request: ServingRequest) -> bool: ...


@final
class RemoteReplica:
    """See the module docstring. `name` is cluster-unique (`{node}/{role}-{index}`)."""

    def __init__(self, member: Courier, node: str, report: ReplicaReport) -> None:
        self.member = member
        self.node = node
        self.report = report
        # Prompt tokens this node sent it since its last report (the router's estimate of its queue).
        self.submitted_tokens = 0
        # The block keys its prefix cache holds as far as reports told (None: unknown until a whole view).
        self.prefix_keys: set[bytes] = set()
        self.prefix_version: int | None = None
        self._take_prefix(report.prefix)

    def update(self, report: ReplicaReport) -> None:
        self.report = report
        self.submitted_tokens = 0
        self._take_prefix(report.prefix)

    def _take_prefix(self, delta: PrefixDelta | None) -> None:
        """Apply a report's prefix-cache delta. The changes are net, newest first wins: a delta from an
        older base applies on a newer view too. A delta from a base this node never saw leaves the view
        unknown (empty) until the next whole view."""
        version = self.prefix_version
        if delta is None:
            self.prefix_keys, self.prefix_version = set(), None
        elif delta.base is None:
            self.prefix_keys, self.prefix_version = set(delta.added), delta.version
        elif version is not None and delta.base <= version:
            self.prefix_keys.difference_update(delta.removed)
            self.prefix_keys.update(delta.added)
            self.prefix_version = max(version, delta.version)
        else:
            self.prefix_keys, self.prefix_version = set(), None

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

    def snapshot(self) -> ReplicaSnapshot:
        """The replica as its node last reported it. It takes prefill work while its node says so (a
        replica serving plainly, or a NewPrefill: `takes_work`), a NewPrefill prompts up to its reported
        limit less the tokens sent since, as its own node's router would; its queue counts as holding
        prompts while it holds tokens (the report carries tokens, not prompts)."""
        report, status = self.report, self.report.status
        role: Role = report.role
        queued = report.queued_prompt_tokens + self.submitted_tokens
        limit = None if report.prefill_limit is None else report.prefill_limit - self.submitted_tokens
        return ReplicaSnapshot(
            name=status.name,
            role=role,
            state=parse_state(status.state),
            serving_role=status.role,
            locked=status.locked,
            lock_reasons=tuple(status.lock_reasons),
            last_error=status.last_error,
            running=True,
            work_queue=status.work_queue,
            migration_queue=status.migration_queue,
            queued_prompts=1 if queued else 0,
            queued_prompt_tokens=queued,
            running_prompt_tokens=report.running_prompt_tokens,
            decoding=0,
            encode_load=report.encode_load,
            embedding_pool=report.embedding_pool,
            takes_prefill=report.takes_work and status.role == "prefill",
            prefill_limit=limit,
            used_blocks=status.used_blocks,
            cached_blocks=status.cached_blocks,
            kv_blocks=report.kv_total,
            total_blocks=status.total_blocks,
            loaded_layers=status.loaded_layers,
            total_layers=status.total_layers,
            weights_source=status.weights_source,
            weights_bytes_loaded=status.weights_bytes_loaded,
            paired_with=tuple(status.paired_with),
            executor=status.executor,
            executor_fallbacks=tuple(status.executor_fallbacks),
            serves_weights=report.serves_weights,
            prefix_blocks=status.prefix_blocks,
        )

    async def ask(self, command: ReplicaCommand, *, timeout: float = 30.0) -> Any:
        """Run `command` on the replica's node; raises `CommandRefused` (`replica_failed` when its node
        does not answer within `timeout`)."""
        return await self.member.run_command(self, command, timeout=timeout)

    def prefix_match(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` its prefix cache holds, as its node last reported."""
        held, count = self.prefix_keys, 0
        for key in keys:
            if key not in held:
                break
            count += 1
        return count

    def submit(self, request: ServingRequest) -> bool:
        """Send `request` to this replica's queue; the node answers `Returned` when the replica does not
        take it. False when this node cannot reach the cluster now."""
        return self.member.submit(self, request)

    def refused(self, why: str) -> CommandRefused:
        return CommandRefused("replica_failed", f"{self.name} (node {self.node}): {why}")
