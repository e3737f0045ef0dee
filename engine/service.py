"""The node's `ControlHandler`: every control op of architecture §7, served against the live replicas.

`generate` admits the request, then relays its updates (streamed tokens, the final result or error).
If the handler is cancelled first — the client disconnected or stopped reading, or the node is shutting
down — the request is cancelled in shielded cleanup: its holder frees its blocks at the next step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, assert_never, final

import msgspec

from engine.control.errors import RequestFailed
from engine.control.outbox import ReplySink
from engine.generation import Generation
from engine.logs import Aggregator, metrics_result
from engine.router import Router
from engine.scaling import pair, scale
from messages.commands import Lock, Transition, Unlock
from messages.control import (
    CancelRequest,
    ControlRequest,
    GenerateRequest,
    LockRequest,
    MetricsRequest,
    ScaleRequest,
    ShutdownRequest,
    StatusRequest,
    TransitionRequest,
    UnlockRequest,
)
from messages.control_replies import (
    CancelResult,
    GenerateResult,
    LockResult,
    ReplicaGauge,
    ReplicaStatus,
    ScaleResult,
    ShutdownResult,
    StatusResult,
    TokenReply,
    TransitionResult,
)
from messages.log.events import RequestCancelled, RequestFinished
from messages.log.events import RequestFailed as RequestFailedEvent
from replicas.actor import Replica
from replicas.inbox import CommandRefused, new_command_id
from replicas.request import FailedUpdate, FinishedUpdate, ServingRequest
from replicas.services import ReplicaServices
from replicas.states import SERVING_ROLE, ReplicaState

if TYPE_CHECKING:
    from engine.node import Node


@final
class NodeService:
    """Implements `engine.control.handler.ControlHandler` for one node."""

    def __init__(self, node: Node, services: ReplicaServices, router: Router, aggregator: Aggregator) -> None:
        self.node = node
        self.services = services
        self.router = router
        self.aggregator = aggregator
        self.started = time.monotonic()

    async def handle(self, request: ControlRequest, replies: ReplySink) -> None:
        match request:
            case GenerateRequest():
                await self._generate(request, replies)
            case StatusRequest():
                member = self.node.member
                replicas = self.statuses() + ([] if member is None else member.ops.statuses())
                replies.send(
                    StatusResult(
                        id=request.id,
                        accepting=self.router.accepting,
                        replicas=replicas,
                        cluster=None if member is None else member.view(),
                    )
                )
            case CancelRequest(request_id=request_id):
                if not self.router.cancel(request_id):
                    member = self.node.member
                    # Admitted by another node of the cluster? Only a client's own cancel asks them.
                    found = None
                    if member is not None and replies.connection.connection != "peer":
                        found = await member.ops.cancel_elsewhere(request, CancelResult)
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
                replies.send(
                    LockResult(id=request.id, replica=name, locked=replica.locked, lock_reasons=reasons)
                )
            case UnlockRequest(replica=name):
                replica = self._replica(name)
                reasons = await self._ask(replica, Unlock(command_id=new_command_id(), reason="manual"))
                replies.send(
                    LockResult(id=request.id, replica=name, locked=replica.locked, lock_reasons=reasons)
                )
            case ScaleRequest():
                if self.node.planner is not None:
                    self.node.planner.manual_scale()
                member = self.node.member
                where = None if member is None else member.ops.place(request.node)
                if member is not None and where != member.node_id:
                    assert where is not None
                    forwarded = msgspec.structs.replace(request, node=where)
                    result = await member.ops.forward(where, forwarded, ScaleResult)
                    replies.send(msgspec.structs.replace(result, id=request.id))
                else:
                    replies.send(await scale(self.node, request))
            case MetricsRequest():
                metrics = metrics_result(
                    self.aggregator,
                    id=request.id,
                    uptime_s=time.monotonic() - self.started,
                    replicas=self.gauges(),
                )
                member = self.node.member
                # The leader adds the cluster's totals (for a client: a node asked by the leader does not).
                if (
                    member is not None
                    and member.membership.is_leader
                    and replies.connection.connection != "peer"
                ):
                    metrics = msgspec.structs.replace(metrics, cluster=await member.ops.totals(metrics))
                replies.send(metrics)
            case ShutdownRequest():
                if request.cluster and self.node.member is not None:
                    local = msgspec.structs.replace(request, cluster=False)
                    await self.node.member.ops.shutdown_others(local, ShutdownResult)
                in_flight = len(self.services.requests)
                self.node.request_shutdown("shutdown op")
                replies.send(
                    ShutdownResult(
                        id=request.id, drain_deadline_s=self.node.drain_deadline, in_flight=in_flight
                    )
                )
            case _:
                assert_never(request)

    # ------------------------------------------------------------------ generate
    async def _generate(self, request: GenerateRequest, replies: ReplySink) -> None:
        if request.request_id is not None:
            replies.request_id = request.request_id
        generation = Generation.start(
            self.services,
            self.router,
            request,
            self.node.served,
            connection=replies.connection.connection,
            on_end=self.log_end,
            token_gap=self.node.metrics.token_gap,
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
                )
            )
        finally:
            generation.close()

    def log_end(self, serving: ServingRequest) -> None:
        log = self.services.log.bind(request_id=serving.request_id)
        update = serving.final_update
        timings = serving.timings()
        if isinstance(update, FailedUpdate):
            log.emit(RequestFailedEvent(code=update.code, message=update.message))
        elif isinstance(update, FinishedUpdate) and update.finish_reason == "cancelled":
            log.emit(RequestCancelled(reason=serving.cancel_reason, output_tokens=len(serving.generated)))
        elif isinstance(update, FinishedUpdate):
            log.emit(
                RequestFinished(
                    finish_reason=update.finish_reason,
                    prompt_tokens=serving.prompt_tokens,
                    output_tokens=len(serving.generated),
                    e2e_s=timings.e2e_s or 0.0,
                    ttft_s=timings.ttft_s,
                    tpot_s=timings.tpot_s,
                )
            )

    # ------------------------------------------------------------------ helpers
    async def _transition(self, replica: Replica, request: TransitionRequest) -> ReplicaState:
        """A commanded move; NewPrefill / OldPrefill pair the replica with a partner (architecture §8)."""
        partner = None if request.paired_with is None else self._replica(request.paired_with)
        previous = replica.state
        if request.to == ReplicaState.NEW_PREFILL.value and replica.state is ReplicaState.LOADING_PREFILL:
            if await pair(self.node, replica, partner) is None:
                raise RequestFailed(
                    "invalid_transition", f"{replica.name} finished loading first; it serves as Prefill"
                )
            return previous
        if request.to == ReplicaState.OLD_PREFILL.value and partner is None:
            new = [r for r in self.services.replicas.values() if r.state is ReplicaState.NEW_PREFILL]
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
        previous = await self._ask(replica, command)
        if request.to == ReplicaState.OLD_PREFILL.value and partner is not None:
            partner.work.new_prefill.add_partner(replica.name)  # so it hints this replica too
        return previous

    def _elsewhere(self, name: str) -> bool:
        """`name` is a replica of another node of the cluster (qualified, or a bare name only it has)."""
        member = self.node.member
        if member is None or name in self.services.replicas:
            return False
        return member.find_remote(name) is not None

    async def _forward_replica_op(
        self, request: TransitionRequest | LockRequest | UnlockRequest, replies: ReplySink
    ) -> None:
        member = self.node.member
        assert member is not None
        remote = member.find_remote(request.replica)
        assert remote is not None
        forwarded = msgspec.structs.replace(request, replica=remote.name)
        if isinstance(request, TransitionRequest):
            transition = await member.ops.forward(remote.node, forwarded, TransitionResult)
            replies.send(msgspec.structs.replace(transition, id=request.id))
        else:
            lock = await member.ops.forward(remote.node, forwarded, LockResult)
            replies.send(msgspec.structs.replace(lock, id=request.id))

    def _replica(self, name: str) -> Replica:
        replica = self.services.replicas.get(name) or self._bare(name)
        if replica is None:
            known = ", ".join(self.services.replicas)
            raise RequestFailed("not_found", f"no replica {name!r}; replicas are {known}")
        return replica

    def _bare(self, name: str) -> Replica | None:
        """A bare `{role}-{n}` names this node's replica `{node}/{role}-{n}` in a cluster."""
        member = self.node.member
        return None if member is None else self.services.replicas.get(f"{member.node_id}/{name}")

    async def _ask(self, replica: Replica, command: Transition | Lock | Unlock) -> Any:
        try:
            return await replica.ask(command)
        except CommandRefused as exc:
            raise RequestFailed(exc.code, str(exc)) from None  # type: ignore[arg-type]

    def statuses(self) -> list[ReplicaStatus]:
        member = self.node.member
        node, pid = (None, None) if member is None else (member.node_id, member.pid)
        return [replica_status(replica, node=node, pid=pid) for replica in self.services.replicas.values()]

    def gauges(self) -> list[ReplicaGauge]:
        return [
            ReplicaGauge(
                name=replica.name,
                state=replica.state.value,
                used_blocks=replica.pools.used_blocks(),
                total_blocks=replica.pools.total_blocks(),
                locked=replica.locked,
            )
            for replica in self.services.replicas.values()
        ]


def replica_status(replica: Replica, *, node: str | None = None, pid: int | None = None) -> ReplicaStatus:
    """`replica` as `status` shows it (in a cluster, with its `node` and that node's `pid`)."""
    work, migration = replica.work.queue_lengths()
    used_kv, _ = replica.pools.kv_usage()
    return ReplicaStatus(
        name=replica.name,
        role=SERVING_ROLE.get(replica.state) or replica.role,
        state=replica.state.value,
        used_blocks=replica.pools.used_blocks(),
        cached_blocks=used_kv,
        total_blocks=replica.pools.total_blocks(),
        locked=replica.locked,
        lock_reasons=sorted(replica.lock_reasons),
        work_queue=work,
        migration_queue=migration,
        last_error=replica.last_error,
        transport=replica.services.fabric.kind,
        loaded_layers=replica.work.loaded_layers,
        total_layers=replica.work.total_layers,
        weights_source=replica.work.weights_source,
        weights_bytes_loaded=replica.work.weights_bytes_loaded,
        paired_with=replica.work.paired_with(),
        node=node,
        pid=pid,
        executor=replica.work.executor_path,
        executor_fallbacks=replica.work.executor_fallbacks,
    )
