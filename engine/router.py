"""The router: admission, first-come-first-served dispatch to prefill replicas, cancellation.

Admitted requests wait in one FCFS queue until a replica in `Prefill` takes them; the replica with the
fewest queued prompt tokens gets the next one, and a replica's own queue holds at most its next batch
(`max_batch_tokens` prompt tokens), so a backlog stays here, where a replica that starts serving later
takes its share. A request sent while replicas are still loading simply
waits here. A replica that stops taking work (role change) hands its unstarted requests back; they go
to the front again. Admission refuses with `overloaded` when `max_queue` requests are live, and a
request that no replica took within `queue_wait` seconds of joining the queue fails with `overloaded`,
naming the replicas it waited for and their states (and last errors): waiting is right while replicas
load or are scaled to zero, but a role whose every replica failed would otherwise hold it forever.

An image request also needs an encode replica (EPD, docs/epd.md): it goes to the least loaded replica
in `Encode` and to a prefill replica with an embedding pool, with one transfer id both use. While no
encode replica is in `Encode`, image requests keep their place in the queue and text requests behind
them go ahead. A node with no encode replica at all refuses image requests (`not_supported`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import final

import trio

from engine.cluster.remote import RemoteReplica
from engine.control.errors import RequestFailed
from messages.log.events import RequestQueued
from replicas.actor import Replica
from replicas.embedding_receive import new_embedding_transfer_id
from replicas.request import EmbeddingRoute, ServingRequest
from replicas.services import ReplicaServices
from replicas.states import ReplicaState

S = ReplicaState


@final
class Router:
    """See the module docstring. Single Trio thread: no locking."""

    def __init__(self, services: ReplicaServices, *, max_queue: int, queue_wait: float = 60.0) -> None:
        self.services = services
        self.max_queue = max_queue
        self.queue_wait = queue_wait
        self.pending: deque[ServingRequest] = deque()
        self._queued_at: dict[str, float] = {}  # request id -> when it (last) joined `pending`
        self.accepting = True
        # Asked before admitting: a reason to refuse this request now (a cluster member that cannot
        # reach the cluster refuses what its own replicas cannot serve, saying when to retry).
        self.refusal: Callable[[ServingRequest], RequestFailed | None] = lambda request: None
        self._idle = trio.Event()
        self._idle.set()
        services.return_work = self.take_back
        services.readiness_changed = self.dispatch

    @property
    def live(self) -> int:
        return len(self.services.requests)

    def admit(self, request: ServingRequest) -> None:
        """Register and queue `request`; raises `RequestFailed` (`shutting_down`, `overloaded`, ...)."""
        if not self.accepting:
            raise RequestFailed("shutting_down", "the node is shutting down and admits no new requests")
        if request.request_id in self.services.requests:
            raise RequestFailed("bad_request", f"request_id {request.request_id!r} is already in use")
        refusal = self.refusal(request)
        if refusal is not None:
            raise refusal
        if self.live >= self.max_queue:
            raise RequestFailed(
                "overloaded", f"{self.live} requests are in flight (max_queue {self.max_queue}); retry later"
            )
        if request.needs_embeddings and not (
            any(r.role == "encode" for r in self.services.replicas.values())
            or any(r.role == "encode" for r in self._remote())
        ):
            raise RequestFailed(
                "not_supported",
                f"this node has no encode replica for the {len(request.images)} images of this request "
                "(add one: --replicas encode=1,... or the scale op with role encode)",
            )
        self.services.requests[request.request_id] = request
        if self._idle.is_set():
            self._idle = trio.Event()
        request.on_end.append(self._forget)
        self.pending.append(request)
        self._queued_at[request.request_id] = trio.current_time()
        self.services.log.bind(request_id=request.request_id).emit(
            RequestQueued(queue="work", position=len(self.pending) - 1)
        )
        self.dispatch()

    def hold(self, request: ServingRequest) -> None:
        """Register a request another node admitted (a cluster mirror): live here until it ends or
        `release`, queued nowhere (the node that sent it chose the replica)."""
        self.services.requests[request.request_id] = request
        if self._idle.is_set():
            self._idle = trio.Event()
        request.on_end.append(self._forget)

    def release(self, request: ServingRequest) -> None:
        """Stop holding a request that went back to its origin (see `hold`)."""
        if request in self.pending:
            self.pending.remove(request)
        self._forget(request)

    def take_back(self, request: ServingRequest) -> None:
        """A replica returns a request it will not start; it goes to the front of the queue (and its
        `queue_wait` starts again)."""
        self.pending.appendleft(request)
        self._queued_at[request.request_id] = trio.current_time()

    def dispatch(self) -> None:
        """Hand pending requests to prefill replicas (called on arrivals and readiness changes)."""
        # Image requests with no encode replica (or no prefill replica with an embedding pool) to go
        # to: they keep their place, and the requests behind them may go ahead.
        waiting_for_encoder: list[ServingRequest] = []
        try:
            while self.pending:
                request = self.pending[0]
                if request.cancelled:
                    self.pending.popleft()
                    request.finish("cancelled")
                    continue
                images = request.needs_embeddings
                replica = self._choose_prefill(request)
                encoder = self._choose_encoder() if images else None
                if images and (replica is None or encoder is None):
                    waiting_for_encoder.append(self.pending.popleft())
                    continue
                if replica is None:
                    return
                self.pending.popleft()
                request.stamps.dispatched = request.stamps.dispatched or time.time()
                if encoder is not None:
                    request.embedding_route = EmbeddingRoute(
                        encoder=encoder.name, transfer_id=new_embedding_transfer_id(request.request_id)
                    )
                    if not encoder.submit(request):
                        request.embedding_route = None
                        self.pending.appendleft(request)
                        return
                if not replica.submit(request):
                    if isinstance(encoder, Replica):
                        encoder.work.encode.withdraw(request)
                    if encoder is not None:
                        request.embedding_route = None
                    self.pending.appendleft(request)
                    return
                self._queued_at.pop(request.request_id, None)
        finally:
            self.pending.extendleft(reversed(waiting_for_encoder))

    def cancel(self, request_id: str) -> bool:
        """Cancel a live request (its holder frees its blocks and ends it `cancelled`)."""
        request = self.services.requests.get(request_id)
        if request is None or request.ended:
            return False
        request.cancel()
        if request in self.pending:
            self.pending.remove(request)
            request.finish("cancelled")
        for replica in self.services.replicas.values():
            replica.post()
        return True

    def _remote(self) -> list[RemoteReplica]:
        """The other nodes' replicas (a cluster that this node reaches now; empty alone)."""
        return [p for p in self.services.peers() if isinstance(p, RemoteReplica)]

    def _choose_prefill(self, request: ServingRequest) -> Replica | RemoteReplica | None:
        """The prefill replica with the fewest queued prompt tokens (this node's first on a tie)."""
        local = self._choose_local_prefill(request)
        budget = self.services.settings.max_batch_tokens
        remote = [
            r
            for r in self._remote()
            if r.report.takes_work
            and r.report.status.role == "prefill"
            and (not r.queued_tokens or r.queued_tokens + request.prompt_tokens <= budget)
            and (not request.needs_embeddings or r.report.embedding_pool)
        ]
        if not remote:
            return local
        best = min(remote, key=lambda r: r.queued_tokens)
        if local is not None and sum(q.prompt_tokens for q in local.work.prefill.queue) <= best.queued_tokens:
            return local
        return best

    def _choose_local_prefill(self, request: ServingRequest) -> Replica | None:
        images = request.needs_embeddings
        budget = self.services.settings.max_batch_tokens
        candidates = [
            r
            for r in self.services.replicas.values()
            if _has_room(r, request, budget)
            and (
                r.state is S.PREFILL
                or (r.state is S.OLD_PREFILL and r.work.old_prefill.takes_new_work())
                or (r.state is S.NEW_PREFILL and r.work.new_prefill.accepts(request))
            )
            and (not images or r.pools.emb_endpoint is not None)
        ]
        if not candidates:
            return None
        return min(candidates, key=lambda r: sum(q.prompt_tokens for q in r.work.prefill.queue))

    def _choose_encoder(self) -> Replica | RemoteReplica | None:
        candidates: list[tuple[int, Replica | RemoteReplica]] = [
            (r.work.encode.load, r) for r in self.services.replicas.values() if r.state is S.ENCODE
        ]
        candidates += [(r.report.encode_load, r) for r in self._remote() if r.state is S.ENCODE]
        if not candidates:
            return None
        return min(candidates, key=lambda pair: pair[0])[1]

    async def expire_waiting(self) -> None:
        """Fail queued requests that waited `queue_wait` seconds; runs until cancelled (node shutdown)."""
        while True:
            await trio.sleep(min(1.0, self.queue_wait / 4))
            now = trio.current_time()
            waited = [
                r for r in self.pending if now - self._queued_at.get(r.request_id, now) >= self.queue_wait
            ]
            for request in waited:
                self.pending.remove(request)
                if request.cancelled:
                    request.finish("cancelled")
                else:
                    request.fail("overloaded", self._why_waiting(request))

    def _why_waiting(self, request: ServingRequest) -> str:
        role = "encode" if request.needs_embeddings and self._choose_encoder() is None else "prefill"
        states = "; ".join(
            f"{r.name} {r.state.value}"
            + (f" (last error: {r.last_error})" if r.state is S.INACTIVE and r.last_error else "")
            for r in self.services.replicas.values()
            if r.role == role
        )
        article = "an" if role == "encode" else "a"
        return (
            f"waited {self.queue_wait:g} s for {article} {role} replica to take it; "
            f"{states or f'no {role} replica'}"
        )

    def _forget(self, request: ServingRequest) -> None:
        self._queued_at.pop(request.request_id, None)
        self.services.requests.pop(request.request_id, None)
        if not self.services.requests:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no request is live."""
        await self._idle.wait()


def _has_room(replica: Replica, request: ServingRequest, budget: int) -> bool:
    """A replica's queue holds at most its next batch (`max_batch_tokens` prompt tokens, or one longer
    prompt): the rest waits here, so a replica that starts serving later (a scale-up) takes its share
    of a backlog instead of finding it committed to the replicas that were there first."""
    queue = replica.work.prefill.queue
    return not queue or sum(r.prompt_tokens for r in queue) + request.prompt_tokens <= budget
