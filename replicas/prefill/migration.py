"""KV migration, prefill side: the migration queue and the task that empties it (architecture §6, seed 004).

Held requests wait in `outbound` (the replica's migration queue) for a decode replica. The
migrator takes the head entry, asks the unlocked `Decode` replicas in turn (round robin) to reserve its
KV all-or-nothing (`ReserveKV`; the decode replica may refuse), and on acceptance streams the prompt's
KV blocks with the resumable transfer while the decode replica receives them straight into the blocks
it reserved. Several migrations run at once (`migrations_in_flight`). When no decode replica accepts,
the entry waits — for a lock to clear or blocks to free: any node-wide change (a decode replica's state,
lock or freed blocks, another node's report) starts another round of asks, at most one every
`RETRY_GAP` seconds — up to `migration_wait`, then fails with `overloaded`. A replica in `MutatingToDecode` adopts the entries still queued instead (`take_unclaimed`).

An entry being offered to decode replicas is *claimed*: flushing skips it; a refusal unclaims it.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from typing import final

import trio

from messages.commands import KVHalf, ReserveKV, SendKVHalf
from messages.log.events import RequestQueued
from replicas.inbox import CommandRefused, new_command_id
from replicas.model import KVCache
from replicas.ports import Actor, Directory, NodeSignal, PeerReplica, peer_named
from replicas.settings import ReplicaSettings
from replicas.states import MIGRATES_KV, ReplicaState
from replicas.step.plan import Held
from transport.endpoint import TransferEndpoint
from transport.errors import TransferError

S = ReplicaState
_transfer_numbers = itertools.count(1)
RETRY_GAP = 0.05  # seconds between two rounds of asks for one entry: a busy node changes often


@final
class Migrator:
    """The migration queue of one prefill replica and its sending task, over its KV cache `kv` and the
    `endpoint` that sends from it; `directory` names the decode replicas it may offer KV to."""

    def __init__(
        self,
        actor: Actor,
        *,
        kv: KVCache,
        endpoint: TransferEndpoint,
        settings: ReplicaSettings,
        directory: Directory,
        changes: NodeSignal,
        context_length: int,
        num_layers: int,
    ) -> None:
        self._actor = actor
        self._kv = kv
        self._endpoint = endpoint
        self._settings = settings
        self._directory = directory
        self._changes = changes
        self._context_length = context_length
        self._num_layers = num_layers
        self.outbound: deque[Held] = deque()
        self.claimed: set[str] = set()
        self.in_flight: dict[str, Held] = {}
        self._wake = trio.Event()
        self._woken = False  # a wake since the last sleep (a sleep then returns at once)
        self._next_decode = 0
        self._queued_at: dict[str, float] = {}

    @property
    def queued(self) -> int:
        return len(self.outbound)

    @property
    def idle(self) -> bool:
        return not self.outbound and not self.in_flight

    def wake(self) -> None:
        self._woken = True
        self._wake.set()

    def enqueue(self, item: Held) -> None:
        self.outbound.append(item)
        self._queued_at[item.request.request_id] = trio.current_time()
        self._actor.log.bind(request_id=item.request.request_id).emit(
            RequestQueued(queue="migration", position=len(self.outbound) - 1)
        )
        self.wake()

    def take_unclaimed(self) -> list[Held]:
        """Remove and return the queued entries no decode replica is being asked about (for Flush)."""
        taken = [item for item in self.outbound if item.request.request_id not in self.claimed]
        self.outbound = deque(item for item in self.outbound if item.request.request_id in self.claimed)
        for item in taken:  # their wait starts again wherever they are queued next
            self._queued_at.pop(item.request.request_id, None)
        return taken

    # ------------------------------------------------------------------ the task
    async def run(self) -> None:
        """Offer queued entries to decode replicas until cancelled (it watches the node's changes while
        it runs)."""
        unwatch = self._changes.watch(self.wake)
        try:
            await self._serve()
        finally:
            unwatch()

    async def _serve(self) -> None:
        settings = self._settings
        while True:
            self._drop_cancelled()
            head = self._head()
            if head is None or len(self.in_flight) >= settings.migrations_in_flight:
                await self._sleep_until(math.inf)
                continue
            request_id = head.request.request_id
            asked = trio.current_time()
            self._woken = False  # a change from now on starts another round of asks
            self.claimed.add(request_id)
            try:
                destination = await self._find_destination(head)
            finally:
                self.claimed.discard(request_id)
            if destination is None:
                queued = self._queued_at.get(request_id, trio.current_time())
                if trio.current_time() - queued >= settings.migration_wait and head in self.outbound:
                    self.outbound.remove(head)
                    self._release(head)
                    head.request.fail(
                        "overloaded",
                        f"no decode replica took the KV of request {request_id} within "
                        f"{settings.migration_wait:g} s (all locked, full or not decoding)",
                    )
                    continue
                await trio.sleep_until(asked + RETRY_GAP)
                await self._sleep_until(queued + settings.migration_wait)
                continue
            # The replica may have stopped while this task was already woken (a woken task takes no
            # cancellation until its next checkpoint): its nursery takes no new task then.
            await trio.lowlevel.checkpoint_if_cancelled()
            if head not in self.outbound:  # flushed or cancelled while we asked: the decode side will
                continue  # see its transfer never start and give the reservation back (orphan timeout)
            self.outbound.remove(head)
            self.in_flight[request_id] = head
            self._actor.spawn(self._send, head, destination)

    def _head(self) -> Held | None:
        if self._actor.state not in MIGRATES_KV:
            return None
        return self.outbound[0] if self.outbound else None

    async def _sleep_until(self, deadline: float) -> None:
        """Until `wake` (an entry, a finished send, a state change, any node-wide change) or `deadline`;
        at once when woken since the last sleep."""
        if not self._woken:
            self._wake = trio.Event()
            with trio.move_on_at(deadline):
                await self._wake.wait()
        self._woken = False

    def _drop_cancelled(self) -> None:
        """Free the entries whose request was cancelled, or ended elsewhere (failed on another node:
        no decode replica will take it, and its blocks must not wait out `migration_wait`)."""
        for item in [i for i in self.outbound if i.request.cancelled or i.request.ended]:
            self.outbound.remove(item)
            self._release(item)
            item.request.finish("cancelled")

    def _release(self, item: Held) -> None:
        self._kv.release(item.table, item.request.request_id)
        self._queued_at.pop(item.request.request_id, None)

    async def _find_destination(self, item: Held) -> tuple[str, str] | None:
        """Ask decode replicas in turn; returns (replica name, transfer id) of the one that accepted."""
        request = item.request
        directory = self._directory
        decoders: list[PeerReplica] = [
            r for r in directory.local() if r.state is S.DECODE and not r.lock_reasons
        ]
        # The other nodes' decode replicas (a cluster); a ZigZag half comes from wherever its NewPrefill
        # partner is (`other_half.source_endpoint`).
        decoders += [p for p in directory.remote() if p.state is S.DECODE and not p.lock_reasons]
        if not decoders:
            return None
        start = self._next_decode % len(decoders)
        context = self._context_length
        for offset in range(len(decoders)):
            decoder = decoders[(start + offset) % len(decoders)]
            if decoder.name == self._actor.name:
                continue
            transfer_id = f"{request.request_id}/kv{next(_transfer_numbers)}"
            layers, other_half = None, None
            source = self._endpoint.name
            split, total = self._split(item)
            if split == total:  # relayed after every layer: all of its KV is on the NewPrefill replica
                assert item.relay is not None
                source = f"{item.relay.new_prefill}/kv"
            elif split > 0:  # ZigZag: two halves, one reservation
                assert item.relay is not None
                layers = (split, total)
                other_half = KVHalf(
                    transfer_id=f"{transfer_id}a",
                    source_endpoint=f"{item.relay.new_prefill}/kv",
                    start=0,
                    stop=split,
                )
            command = ReserveKV(
                command_id=new_command_id(),
                request_id=request.request_id,
                transfer_id=transfer_id,
                source_endpoint=source,
                prompt_tokens=request.prompt_tokens,
                capacity_tokens=request.kv_capacity_tokens(context),
                layers=layers,
                other_half=other_half,
            )
            try:
                await decoder.ask(command, timeout=self._settings.kv_transfer.handshake_timeout)
            except CommandRefused:  # refused, or no answer within the handshake timeout
                continue
            self._next_decode = start + offset + 1
            return decoder.name, transfer_id
        return None

    async def _send(self, item: Held, destination: tuple[str, str]) -> None:
        """Stream the prompt's KV; the decode replica is receiving it (see `DecodeWork.reserve`)."""
        request = item.request
        endpoint = self._endpoint
        _, transfer_id = destination
        if request.stamps.kv_started is None:
            request.stamp("kv_started")
        error: BaseException | None = None
        split, total = self._split(item)
        if split > 0:  # the NewPrefill partner sends layers [0, split): the whole KV when split == L
            half = transfer_id if split == total else f"{transfer_id}a"
            sent = await self._other_half_sent(item, half)
            if split == total or not sent:  # nothing of its own to send, or the request failed
                self._actor.later(lambda: self._sent(item, None))
                return
        with request.work_scope():  # also when the decode side failed the request: no grant will come
            try:
                async with endpoint.open_send(transfer_id) as session:
                    await session.send(item.table, total_tokens=request.prompt_tokens)
            except TransferError as exc:
                error = exc
        self._actor.later(lambda: self._sent(item, error))

    def _split(self, item: Held) -> tuple[int, int]:
        """(n, L): this replica computed the KV of layers `[n, L)` (n = 0 unless relayed)."""
        return (0 if item.relay is None else item.relay.layer), self._num_layers

    async def _other_half_sent(self, item: Held, transfer_id: str) -> bool:
        """Tell the NewPrefill partner to send its half (layers `[0, n)`); False (the request failed)
        when it cannot — it failed, or no longer holds the half."""
        assert item.relay is not None
        request = item.request
        partner = peer_named(self._directory, item.relay.new_prefill)
        command = SendKVHalf(
            command_id=new_command_id(), request_id=request.request_id, transfer_id=transfer_id
        )
        problem: str | None = f"{item.relay.new_prefill} is gone"
        if partner is not None:
            try:
                await partner.ask(command, timeout=self._settings.kv_transfer.handshake_timeout)
                problem = None
            except CommandRefused as exc:
                problem = str(exc)
        if problem is not None and not request.cancelled:
            request.fail(
                "replica_failed",
                f"request {request.request_id}: {item.relay.new_prefill} could not send its KV of layers "
                f"[0, {item.relay.layer}): {problem}",
            )
        return problem is None

    def _sent(self, item: Held, error: BaseException | None) -> None:
        request = item.request
        self.in_flight.pop(request.request_id, None)
        self._release(item)
        if request.cancelled:  # first: a cancel aborts the transfer, and that abort is no failure
            request.finish("cancelled")
        elif error is not None and isinstance(error, TransferError):
            request.fail(error.code, f"KV migration of request {request.request_id} failed: {error}")
        self.wake()
