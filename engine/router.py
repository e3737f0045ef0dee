"""The router: admission, first-come-first-served dispatch to prefill replicas, cancellation.

Admitted requests wait in one FCFS queue until a replica in `Prefill` takes them; the cheapest replica
gets the next one — KV-aware (docs/prefix-cache.md): cost = `route_weight` × the prompt's blocks it would
compute (those not in its prefix cache) + the blocks of the prompts ahead of it there (queued, and in the
batch it computes now: an idle replica has none, so a prompt never waits behind a busy replica while an
idle one could take it), fewest such prompt tokens on a tie —
a replica that would pull the prefix another one holds counts those blocks as `1 − ratio` held
(`engine.prefix_pull`; `--prefix-pull`), and is told to pull them (`ServingRequest.pull_from`) —
and a replica's own queue holds at most its next batch
(`max_batch_tokens` prompt tokens), so a backlog stays here, where a replica that starts serving later
takes its share. During a ZigZag episode (docs/zigzag.md) an OldPrefill takes no prompt of at most a
batch while one of its NewPrefill partners has spare compute: the OldPrefill is the bottleneck, and a
prompt costs it only the layers the NewPrefill lacks when relayed, all of them when sent whole — the
prompt waits here for the NewPrefill's room instead. A request sent while replicas are still loading
simply waits here. A replica that stops taking work (role change) hands its unstarted requests back; they go
to the front again. Admission refuses with `overloaded` when `max_queue` requests are live, and a
request that no replica took within `queue_wait` seconds of joining the queue fails with `overloaded`,
naming the replicas it waited for and their states (and last errors): waiting is right while replicas
load or are scaled to zero, but a role whose every replica failed would otherwise hold it forever.

An image request also needs an encode replica (EPD, docs/epd.md): it goes to the least loaded replica
in `Encode` and to a prefill replica with an embedding pool, with one transfer id both use. While no
encode replica is in `Encode`, image requests keep their place in the queue and text requests behind
them go ahead. A node with no encode replica at all refuses image requests (`not_supported`).

The router reads replicas — this node's and, in a cluster, the others' — only through their snapshots
(`replicas.snapshot`: what each accepts, its queued prompt tokens, its image load) and reaches them only
by `submit` and commands (`WithdrawEncode`). It is told of readiness changes by the node-wide signal,
and of requests a replica gives back by the replicas' `returned` event; a request another node admitted
and this node only holds (`hold`) goes to `held_returned` instead, for the cluster to send back. Queued
requests expire at their deadline, not on a polling tick.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import final

import trio

from engine.control.errors import RequestFailed
from engine.prefix_pull import PullEstimate
from messages.commands import WithdrawEncode
from messages.log.events import RequestQueued
from replicas.inbox import new_command_id
from replicas.ports import Directory, EventSink, PeerReplica
from replicas.prefill.embeddings import new_embedding_transfer_id
from replicas.request import EmbeddingRoute, ServingRequest
from replicas.settings import ReplicaSettings
from replicas.signals import Subscribers
from replicas.states import ReplicaState

S = ReplicaState


@final
class Router:
    """See the module docstring. Single Trio thread: no locking. `requests` holds the node's live
    requests (what replicas look up by id); replicas read, only the router registers and forgets them.
    Replicas and other nodes are chosen by their snapshots (`replicas.snapshot`)."""

    def __init__(
        self,
        directory: Directory,
        log: EventSink,
        *,
        settings: ReplicaSettings,
        max_queue: int,
        queue_wait: float = 60.0,
        route_weight: float = 1.0,
        prefix_keys: Callable[[ServingRequest], list[bytes]] = lambda request: [],
        pull: PullEstimate | None = None,
    ) -> None:
        """`prefix_keys`: a request's prompt block keys as the prefill replicas' prefix caches key them
        (empty: routing by queue alone). `pull`: whether a prefix cached elsewhere is worth pulling
        (None: never)."""
        self._directory = directory
        self._log = log
        self._budget = settings.max_batch_tokens
        self._block_size = settings.kv_block_size
        self._route_weight = route_weight
        self._prefix_keys = prefix_keys
        self.pull = pull
        self._keys: dict[str, list[bytes]] = {}  # request id -> its keys, while it waits here
        self.max_queue = max_queue
        self.queue_wait = queue_wait
        self.requests: dict[str, ServingRequest] = {}
        self.pending: deque[ServingRequest] = deque()
        self._queued_at: dict[str, float] = {}  # request id -> when it (last) joined `pending`
        self._joined = trio.Event()  # set when a request joins `pending` (the expiry loop's wake-up)
        self._held: set[str] = set()  # requests another node admitted, held here (`hold`)
        # A held request a replica gave back (the cluster sends it back to its origin).
        self.held_returned: Subscribers[ServingRequest] = Subscribers()
        self.accepting = True
        # Asked before admitting: a reason to refuse this request now (a cluster member that cannot
        # reach the cluster refuses what its own replicas cannot serve, saying when to retry).
        self.refusal: Callable[[ServingRequest], RequestFailed | None] = lambda request: None
        self._idle = trio.Event()
        self._idle.set()

    @property
    def live(self) -> int:
        return len(self.requests)

    @property
    def pending_tokens(self) -> int:
        """The prompt tokens waiting here (the one place they are summed)."""
        return sum(request.prompt_tokens for request in self.pending)

    def admit(self, request: ServingRequest) -> None:
        """Register and queue `request`; raises `RequestFailed` (`shutting_down`, `overloaded`, ...)."""
        if not self.accepting:
            raise RequestFailed("shutting_down", "the node is shutting down and admits no new requests")
        if request.request_id in self.requests:
            raise RequestFailed("bad_request", f"request_id {request.request_id!r} is already in use")
        refusal = self.refusal(request)
        if refusal is not None:
            raise refusal
        if self.live >= self.max_queue:
            raise RequestFailed(
                "overloaded", f"{self.live} requests are in flight (max_queue {self.max_queue}); retry later"
            )
        if request.needs_embeddings and not any(
            peer.snapshot().role == "encode" for peer in self._everyone()
        ):
            raise RequestFailed(
                "not_supported",
                f"this node has no encode replica for the {len(request.images)} images of this request "
                "(add one: --replicas encode=1,... or the scale op with role encode)",
            )
        self.requests[request.request_id] = request
        if self._idle.is_set():
            self._idle = trio.Event()
        request.on_end.append(self._forget)
        self._join(request)
        self.pending.append(request)
        self._log.bind(request_id=request.request_id).emit(
            RequestQueued(queue="work", position=len(self.pending) - 1)
        )
        self.dispatch()

    def hold(self, request: ServingRequest) -> None:
        """Register a request another node admitted (a cluster mirror): live here until it ends or
        `release`, queued nowhere (the node that sent it chose the replica); a replica that gives it back
        tells `held_returned`."""
        self.requests[request.request_id] = request
        self._held.add(request.request_id)
        if self._idle.is_set():
            self._idle = trio.Event()
        request.on_end.append(self._forget)

    def release(self, request: ServingRequest) -> None:
        """Stop holding a request that went back to its origin (see `hold`)."""
        if request in self.pending:
            self.pending.remove(request)
        self._forget(request)

    def returned(self, request: ServingRequest) -> None:
        """A replica gives back a request it will not start: a held one goes to `held_returned`, one
        admitted here to the front of the queue (`take_back`)."""
        if request.request_id in self._held:
            self.held_returned(request)
        else:
            self.take_back(request)

    def take_back(self, request: ServingRequest) -> None:
        """Queue `request` at the front again (and its `queue_wait` starts again)."""
        self._join(request)
        self.pending.appendleft(request)

    def _join(self, request: ServingRequest) -> None:
        self._queued_at[request.request_id] = trio.current_time()
        self._joined.set()

    def _everyone(self) -> list[PeerReplica]:
        """This node's replicas, then the other nodes' that take work now (none alone)."""
        return [*self._directory.local(), *self._directory.remote()]

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
                replica, pull = self._choose_prefill(request)
                encoder = self._choose_encoder() if images else None
                if images and (replica is None or encoder is None):
                    waiting_for_encoder.append(self.pending.popleft())
                    continue
                if replica is None:
                    return
                self.pending.popleft()
                request.stamp_first("dispatched")
                if encoder is not None:
                    route = EmbeddingRoute(encoder.name, new_embedding_transfer_id(request.request_id))
                    request.route_embeddings(route)
                    if not encoder.submit(request):
                        request.route_embeddings(None)
                        self.pending.appendleft(request)
                        return
                request.hint_pull(*(pull or (None, 0)))
                if not replica.submit(request):
                    if encoder is not None:
                        self._withdraw(encoder, request)
                        request.route_embeddings(None)
                    self.pending.appendleft(request)
                    return
                self._queued_at.pop(request.request_id, None)
                self._keys.pop(request.request_id, None)
        finally:
            self.pending.extendleft(reversed(waiting_for_encoder))

    def _withdraw(self, encoder: PeerReplica, request: ServingRequest) -> None:
        """The language side could not be placed after all: a local encoder drops the job."""
        local = self._directory.get(encoder.name)
        route = request.embedding_route
        if local is not None and route is not None:
            local.tell(WithdrawEncode(command_id=new_command_id(), transfer_id=route.transfer_id))

    def cancel(self, request_id: str) -> bool:
        """Cancel a live request (its holder frees its blocks and ends it `cancelled`)."""
        request = self.requests.get(request_id)
        if request is None or request.ended:
            return False
        request.cancel()
        if request in self.pending:
            self.pending.remove(request)
            request.finish("cancelled")
        for replica in self._directory.local():
            replica.post()
        return True

    def _choose_prefill(self, request: ServingRequest) -> tuple[PeerReplica | None, tuple[str, int] | None]:
        """The cheapest prefill replica that takes `request` and has room (see the module docstring;
        fewest prompt tokens ahead, then this node's, on a tie), and the replica it should pull its
        prefix from with how many blocks that one holds (None: no pull)."""
        tokens, images = request.prompt_tokens or len(request.prompt_ids), request.needs_embeddings
        candidates = []
        everyone = self._everyone()
        local = len(self._directory.local())
        snaps = {peer.name: peer.snapshot() for peer in everyone}
        for index, peer in enumerate(everyone):
            snap = snaps[peer.name]
            if snap.has_room(tokens, self._budget) and snap.takes(tokens, images=images):
                if snap.state is S.OLD_PREFILL and tokens <= self._budget:
                    spare = (snaps.get(name) for name in snap.paired_with)
                    if any(p is not None and p.spare_compute(images=images) for p in spare):
                        continue  # it waits for the NewPrefill's loaded layers (docs/zigzag.md)
                candidates.append((snap.prompt_tokens_ahead, index >= local, peer))
        pulls = self.pull is not None and not request.has_images and request.prompt_logprobs is None
        discount = self.pull.discount() if self.pull is not None and pulls else 0.0
        if len(candidates) < 2 and not (candidates and discount > 0):
            return (candidates[0][2] if candidates else None), None
        keys: list[bytes] = []
        if self._route_weight > 0 or discount > 0:
            keys = self._keys.get(request.request_id) or self._keys.setdefault(
                request.request_id, self._prefix_keys(request)
            )
        # A pull (docs/prefix-cache.md): the replica that holds the longest prefix, whatever it does.
        holder, most = "", 0
        if discount > 0 and keys:
            for peer in everyone:
                held = peer.prefix_match(keys)
                if held > most:
                    holder, most = peer.name, held
        blocks = -(-tokens // self._block_size)
        best: tuple[float, int, bool, PeerReplica, int] | None = None
        for ahead, remote, peer in candidates:
            held = peer.prefix_match(keys) if keys else 0
            pulled = most - held if most > held and peer.name != holder else 0
            cost = self._route_weight * (blocks - held - discount * pulled) + -(-ahead // self._block_size)
            key = (cost, ahead, remote, peer, held)
            if best is None or key[:3] < best[:3]:
                best = key
        if best is None:
            return None, None
        chosen, held = best[3], best[4]
        pull = (holder, most) if most > held and chosen.name != holder else None
        return chosen, pull

    def _choose_encoder(self) -> PeerReplica | None:
        """The encode replica with the least image load (this node's first on a tie)."""
        best: tuple[int, PeerReplica] | None = None
        for peer in self._everyone():
            snap = peer.snapshot()
            if snap.state is S.ENCODE and (best is None or snap.encode_load < best[0]):
                best = (snap.encode_load, peer)
        return None if best is None else best[1]

    async def expire_waiting(self) -> None:
        """Fail queued requests that waited `queue_wait` seconds, each when its time is up; runs until
        cancelled (node shutdown). Sleeps until the earliest deadline, or until a request joins an empty
        queue."""
        while True:
            deadlines = [self._deadline(r) for r in self.pending if r.request_id in self._queued_at]
            wake = min(deadlines) if deadlines else math.inf
            self._joined = trio.Event()
            with trio.move_on_at(wake):
                await self._joined.wait()
            now = trio.current_time()
            waited = [r for r in self.pending if r.request_id in self._queued_at and self._deadline(r) <= now]
            for request in waited:
                self.pending.remove(request)
                if request.cancelled:
                    request.finish("cancelled")
                else:
                    request.fail("overloaded", self._why_waiting(request))

    def _deadline(self, request: ServingRequest) -> float:
        return self._queued_at[request.request_id] + self.queue_wait

    def _why_waiting(self, request: ServingRequest) -> str:
        role = "encode" if request.needs_embeddings and self._choose_encoder() is None else "prefill"
        snaps = [r.snapshot() for r in self._directory.local()]
        states = "; ".join(
            f"{r.name} {r.state.value}"
            + (f" (last error: {r.last_error})" if r.state is S.INACTIVE and r.last_error else "")
            for r in snaps
            if r.role == role
        )
        article = "an" if role == "encode" else "a"
        return (
            f"waited {self.queue_wait:g} s for {article} {role} replica to take it; "
            f"{states or f'no {role} replica'}"
        )

    def _forget(self, request: ServingRequest) -> None:
        self._queued_at.pop(request.request_id, None)
        self._keys.pop(request.request_id, None)
        self._held.discard(request.request_id)
        self.requests.pop(request.request_id, None)
        if not self.requests:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no request is live."""
        await self._idle.wait()
