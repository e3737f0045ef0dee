"""The node's `ControlHandler`: every control op of architecture §7, served against the live replicas.

`generate` admits the request, then relays its updates (streamed tokens, the final result or error).
If the handler is cancelled first — the client disconnected or stopped reading, or the node is shutting
down — the request is cancelled in shielded cleanup: its holder frees its blocks at the next step.

Replicas are read through their snapshots and reached by commands. In a cluster the ops that reach
past this node (another node's replica, a cancel of a request admitted elsewhere, a scale placed
elsewhere, the cluster's totals, a cluster shutdown) go through `Cluster`, a small protocol the cluster
member implements (`engine.cluster`); the handler imports nothing of it. A manual `scale` is told to
`scaled_manually` (the planner pauses).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, assert_never, final

import msgspec

from engine.control.errors import RequestFailed
from engine.control.outbox import ReplySink
from engine.core import NodeCore
from engine.generate.generation import Generation
from engine.generate.logprobs import prompt_records, records
from engine.logs import Aggregator, metrics_result
from engine.scaling import pair, scale
from messages.commands import Lock, Transition, Unlock
from messages.control import (
    CancelRequest,
    ControlRequest,
    GenerateRequest,
    LockRequest,
    MetricsRequest,
    ReleaseRequest,
    ScaleRequest,
    ShutdownRequest,
    StatusRequest,
    TransitionRequest,
    UnlockRequest,
)
from messages.control_replies import (
    CancelResult,
    ClusterTotals,
    ClusterView,
    GenerateResult,
    LockResult,
    MetricsResult,
    ReleaseResult,
    ReplicaGauge,
    ReplicaStatus,
    ScaleResult,
    ShutdownResult,
    StatusResult,
    TokenReply,
    TransitionResult,
)
from replicas.actor import Replica
from replicas.inbox import CommandRefused, new_command_id
from replicas.signals import Subscribers
from replicas.snapshot import ReplicaSnapshot
from replicas.states import EPISODE_START, ZIGZAG_NEW, ZIGZAG_OLD, ZIGZAG_STARTS, ReplicaState

R = TypeVar("R")


class Cluster(Protocol):
    """What the handler asks of the cluster this node is a member of (`engine.cluster`)."""

    @property
    def node_id(self) -> str: ...

    @property
    def pid(self) -> int: ...

    @property
    def is_leader(self) -> bool: ...

    def view(self) -> ClusterView: ...

    def remote_statuses(self) -> list[ReplicaStatus]:
        """The other nodes' replicas as they last reported them."""
        ...

    def locate(self, name: str) -> tuple[str, str] | None:
        """Another node's replica called `name` (its cluster name, or a bare `{role}-{n}` only one node
        has): (its cluster name, its node); None when there is none."""
        ...

    def place(self, wanted: str | None) -> str:
        """The node a `scale` runs on."""
        ...

    async def forward(self, node: str, request: ControlRequest, result_type: type[R]) -> R: ...

    async def cancel_elsewhere(self, request: ControlRequest, result_type: type[R]) -> R | None: ...

    async def shutdown_others(self, request: ControlRequest, result_type: type[R]) -> list[str]: ...

    async def totals(self, mine: MetricsResult) -> ClusterTotals: ...


@final
class NodeService:
    """Implements `engine.control.handler.ControlHandler` for one node (`core`); `cluster`: its cluster
    (None alone); `token_gap(seconds, tokens)` observes the gaps between relayed tokens."""

    def __init__(
        self,
        core: NodeCore,
        aggregator: Aggregator,
        *,
        cluster: Cluster | None = None,
        token_gap: Callable[[float, int], None] | None = None,
    ) -> None:
        self.core = core
        self.router = core.router
        self.aggregator = aggregator
        self.cluster = cluster
        self.token_gap = token_gap
        # Told of every `scale` op this handler serves (the planner waits a while after one).
        self.scaled_manually: Subscribers[None] = Subscribers()
        self.started = time.monotonic()

    async def handle(self, request: ControlRequest, replies: ReplySink) -> None:
        match request:
            case GenerateRequest():
                await self._generate(request, replies)
            case StatusRequest():
                cluster = self.cluster
                replicas = self.statuses() + ([] if cluster is None else cluster.remote_statuses())
                replies.send(
                    StatusResult(
                        id=request.id,
                        accepting=self.router.accepting,
                        replicas=replicas,
                        cluster=None if cluster is None else cluster.view(),
                    )
                )
            case CancelRequest(request_id=request_id):
                if not self.router.cancel(request_id):
                    cluster = self.cluster
                    # Admitted by another node of the cluster? Only a client's own cancel asks them.
                    found = None
                    if cluster is not None and replies.connection.connection != "peer":
                        found = await cluster.cancel_elsewhere(request, CancelResult)
                    if found is None:
                        raise RequestFailed("not_found", f"no live request {request_id!r}")
                replies.send(CancelResult(id=request.id, request_id=request_id))
            case TransitionRequest() | LockRequest() | UnlockRequest() if self._elsewhere(request.replica):
                await self._forward_replica_op(request, replies)
            case TransitionRequest(replica=name, to=to):
                replica = self._replica(name)
                previous = await self._transition(replica, request)
                # The state the command entered: an automatic move (AusDecode → Decode, a quick load)
                # may already have followed by now; `status` shows where the replica is.
                replies.send(TransitionResult(id=request.id, replica=name, previous=previous.value, state=to))
            case LockRequest(replica=name):
                replica = self._replica(name)
                reasons = await self._ask(replica, Lock(command_id=new_command_id(), reason="manual"))
                locked = replica.snapshot().locked
                replies.send(LockResult(id=request.id, replica=name, locked=locked, lock_reasons=reasons))
            case UnlockRequest(replica=name):
                replica = self._replica(name)
                reasons = await self._ask(replica, Unlock(command_id=new_command_id(), reason="manual"))
                locked = replica.snapshot().locked
                replies.send(LockResult(id=request.id, replica=name, locked=locked, lock_reasons=reasons))
            case ScaleRequest():
                self.scaled_manually(None)
                cluster = self.cluster
                where = None if cluster is None else cluster.place(request.node)
                if cluster is not None and where != cluster.node_id:
                    assert where is not None
                    forwarded = msgspec.structs.replace(request, node=where)
                    result = await cluster.forward(where, forwarded, ScaleResult)
                    replies.send(msgspec.structs.replace(result, id=request.id))
                else:
                    replies.send(await scale(self.core, request))
            case MetricsRequest():
                metrics = metrics_result(
                    self.aggregator,
                    id=request.id,
                    uptime_s=time.monotonic() - self.started,
                    replicas=self.gauges(),
                )
                cluster = self.cluster
                # The leader adds the cluster's totals (for a client: a node asked by the leader does not).
                if cluster is not None and cluster.is_leader and replies.connection.connection != "peer":
                    metrics = msgspec.structs.replace(metrics, cluster=await cluster.totals(metrics))
                replies.send(metrics)
            case ShutdownRequest():
                if request.cluster and self.cluster is not None:
                    local = msgspec.structs.replace(request, cluster=False)
                    await self.cluster.shutdown_others(local, ShutdownResult)
                in_flight = len(self.router.requests)
                self.core.request_shutdown("shutdown op")
                replies.send(
                    ShutdownResult(
                        id=request.id, drain_deadline_s=self.core.drain_deadline, in_flight=in_flight
                    )
                )
            case ReleaseRequest(fault=fault):
                released = self.core.faults.release_holds()
                replies.send(ReleaseResult(id=request.id, fault=fault, released=released))
            case _:
                assert_never(request)

    # ------------------------------------------------------------------ generate
    async def _generate(self, request: GenerateRequest, replies: ReplySink) -> None:
        if request.request_id is not None:
            replies.request_id = request.request_id
        generation = Generation.start(
            self.core.host,
            self.core.settings,
            self.router,
            self.core.log,
            request,
            self.core.served,
            connection=replies.connection.connection,
            token_gap=self.token_gap,
        )
        replies.request_id = generation.request_id
        generation.cancel_reason = lambda: (
            replies.cancelled_because or ("shutdown" if not self.router.accepting else "client_disconnected")
        )
        try:
            async for piece in generation.pieces():
                if request.stream:
                    replies.send(
                        TokenReply(
                            id=request.id,
                            request_id=generation.request_id,
                            index=piece.index,
                            token_ids=list(piece.token_ids),
                            text=piece.text,
                            logprobs=None if piece.logprobs is None else records(piece.logprobs),
                        )
                    )
            outcome = generation.outcome()
            replies.send(
                GenerateResult(
                    id=request.id,
                    request_id=outcome.request_id,
                    prompt_tokens=outcome.prompt_tokens,
                    token_ids=outcome.token_ids,
                    text=outcome.text,
                    finish_reason=outcome.finish_reason,
                    timings=outcome.timings,
                    transfers=outcome.transfers,
                    relay=outcome.relay,
                    logprobs=None if outcome.logprobs is None else records(outcome.logprobs),
                    prompt_logprobs=None
                    if outcome.prompt_logprobs is None
                    else prompt_records(outcome.prompt_logprobs),
                    cached_tokens=outcome.cached_tokens,
                    cached_from=outcome.cached_from,
                )
            )
        finally:
            generation.close()

    # ------------------------------------------------------------------ helpers
    async def _transition(self, replica: Replica, request: TransitionRequest) -> ReplicaState:
        """A commanded move; NewPrefill / OldPrefill pair the replica with a partner (architecture §8)."""
        partner = None if request.paired_with is None else self._replica(request.paired_with)
        previous, target = replica.state, ReplicaState(request.to)
        if (previous, target) in ZIGZAG_STARTS and target in ZIGZAG_NEW:
            if await pair(self.core, replica, partner) is None:
                raise RequestFailed(
                    "invalid_transition", f"{replica.name} finished loading first; it serves as Prefill"
                )
            return previous
        if target in ZIGZAG_OLD and partner is None:
            new = [r for r in self.core.directory.local() if r.state is EPISODE_START["new"]]
            if not new:
                raise RequestFailed(
                    "invalid_transition", f"{replica.name}: no NewPrefill replica to pair with as OldPrefill"
                )
            partner = new[0]
        command = Transition(
            command_id=new_command_id(),
            to=request.to,
            source=request.source,
            paired_with=None if partner is None else partner.name,
        )
        # An OldPrefill replica tells its NewPrefill partner of the pairing itself (`AddRelayPartner`).
        return await self._ask(replica, command)

    def _elsewhere(self, name: str) -> bool:
        """`name` is a replica of another node of the cluster (qualified, or a bare name only it has)."""
        cluster = self.cluster
        if cluster is None or name in self.core.directory:
            return False
        return cluster.locate(name) is not None

    async def _forward_replica_op(
        self, request: TransitionRequest | LockRequest | UnlockRequest, replies: ReplySink
    ) -> None:
        cluster = self.cluster
        assert cluster is not None
        located = cluster.locate(request.replica)
        assert located is not None
        name, node = located
        forwarded = msgspec.structs.replace(request, replica=name)
        if isinstance(request, TransitionRequest):
            transition = await cluster.forward(node, forwarded, TransitionResult)
            replies.send(msgspec.structs.replace(transition, id=request.id))
        else:
            lock = await cluster.forward(node, forwarded, LockResult)
            replies.send(msgspec.structs.replace(lock, id=request.id))

    def _replica(self, name: str) -> Replica:
        directory = self.core.directory
        replica = directory.get(name) or self._bare(name)
        if replica is None:
            known = ", ".join(directory)
            raise RequestFailed("not_found", f"no replica {name!r}; replicas are {known}")
        return replica

    def _bare(self, name: str) -> Replica | None:
        """A bare `{role}-{n}` names this node's replica `{node}/{role}-{n}` in a cluster."""
        cluster = self.cluster
        return None if cluster is None else self.core.directory.get(f"{cluster.node_id}/{name}")

    async def _ask(self, replica: Replica, command: Transition | Lock | Unlock) -> Any:
        try:
            return await replica.ask(command)
        except CommandRefused as exc:
            raise RequestFailed(exc.code, str(exc)) from None

    def statuses(self) -> list[ReplicaStatus]:
        cluster = self.cluster
        node, pid = (None, None) if cluster is None else (cluster.node_id, cluster.pid)
        transport = self.core.fabric.kind
        return [
            replica_status(r.snapshot(), transport=transport, node=node, pid=pid)
            for r in self.core.directory.local()
        ]

    def gauges(self) -> list[ReplicaGauge]:
        return [
            ReplicaGauge(
                name=snap.name,
                state=snap.state.value,
                used_blocks=snap.used_blocks,
                total_blocks=snap.total_blocks,
                locked=snap.locked,
            )
            for snap in (r.snapshot() for r in self.core.directory.local())
        ]


def replica_status(
    snap: ReplicaSnapshot, *, transport: str, node: str | None = None, pid: int | None = None
) -> ReplicaStatus:
    """A replica's snapshot as `status` shows it (in a cluster, with its `node` and that node's `pid`);
    `transport`: the node's fabric's."""
    return ReplicaStatus(
        name=snap.name,
        role=snap.serving_role,
        state=snap.state.value,
        used_blocks=snap.used_blocks,
        cached_blocks=snap.cached_blocks,
        total_blocks=snap.total_blocks,
        locked=snap.locked,
        lock_reasons=list(snap.lock_reasons),
        work_queue=snap.work_queue,
        migration_queue=snap.migration_queue,
        last_error=snap.last_error,
        transport=transport,
        loaded_layers=snap.loaded_layers,
        total_layers=snap.total_layers,
        weights_source=snap.weights_source,
        weights_bytes_loaded=snap.weights_bytes_loaded,
        paired_with=list(snap.paired_with),
        node=node,
        pid=pid,
        executor=snap.executor,
        executor_fallbacks=list(snap.executor_fallbacks),
        prefix_blocks=snap.prefix_blocks,
    )
