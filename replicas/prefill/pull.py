"""Pulling a cached prefix from another replica instead of computing it (docs/prefix-cache.md, "Pulls").

The router names, with a request it hands to a prefill replica, a replica that holds more of the
prompt's leading blocks in its prefix cache (`ServingRequest.pull_from`, `pull_blocks`). Before the
prompt runs, its prefill replica (`Puller`, the receiving side):

1. borrows the prefix its own cache holds (a borrowing under the request's id, as `PrefixLookup.borrow`
   does at the start of a batch) and reserves blocks for the rest of the holder's prefix — at most all
   but the prompt's last token, which must run; no free block: no pull;
2. asks the holder (`SendCachedKV`, any node) to send those blocks by key, and receives them into the
   reserved blocks over the ordinary transfer protocol (`TransferEndpoint.receive` with borrowed blocks:
   the same resumable rounds, deadlines, aborts and fences as a KV migration);
3. publishes what landed in its own cache (`PrefixCache.publish`: its parent chain is the borrowed local
   prefix) and queues the prompt again: its batch starts after the whole prefix (`take`).

The holder (`lend`) borrows the chain it holds of the keys for the length of the send — those blocks
cannot be evicted while they move — and releases the borrowing when the send ends, however it ends.

A holder that is gone, refuses (the keys were evicted meanwhile), sends fewer blocks, or fails mid-send
(killed, link lost, no progress): what landed is dropped (`receive` returns only after the transfer's
fence, so no write can still land in those blocks), the reserved blocks go back to the pool, and the
prompt runs from what the replica held itself. The request never fails because of a pull. A request
cancelled while pulling has its transfer aborted (the pull runs in its work scope).

Single Trio thread: `start` and `take` run in the actor's main loop; the pull task posts its outcome
there (`Actor.later`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import final

from messages.commands import SendCachedKV
from messages.log.events import TransferFinished, TransferStarted
from messages.transfer import FailureReason
from replicas.fabric import Fabric, UnknownEndpoint
from replicas.inbox import CommandRefused, new_command_id
from replicas.model import KVCache, Model
from replicas.ports import Actor, Directory, PeerReplica
from replicas.prefill.prefix import model_identity, prompt_keys
from replicas.request import ServingRequest
from replicas.settings import ReplicaSettings
from transport.endpoint import TransferEndpoint
from transport.errors import HandshakeRefused, LinkError, TransferError
from transport.memory.prefix_cache import PrefixCache

_pull_numbers = itertools.count(1)


@final
class Puller:
    """The receiving side of pulls for one prefill replica (see the module docstring)."""

    def __init__(
        self,
        actor: Actor,
        *,
        kv: KVCache,
        endpoint: TransferEndpoint,
        fabric: Fabric,
        directory: Directory,
        settings: ReplicaSettings,
        model: Callable[[], Model | None],
        ended: Callable[[ServingRequest], None],
    ) -> None:
        """`ended`: a request's pull ended (main loop; `take` has its blocks)."""
        self._actor = actor
        self._kv = kv
        self._endpoint = endpoint
        self._fabric = fabric
        self._directory = directory
        self._settings = settings
        self._model = model
        self._ended = ended
        # Request id -> the blocks its prompt starts with (borrowed and pulled) once its pull ended, and
        # the replica they were pulled from (None: nothing landed).
        self._ready: dict[str, tuple[list[int], str | None]] = {}

    def start(self, request: ServingRequest) -> bool:
        """Start pulling `request`'s prefix when its hint names a replica holding more of it than this
        replica's cache does (main loop). False: nothing to pull; the prompt borrows as usual."""
        cache, model = self._kv.prefix, self._model()
        holder_name = request.pull_from
        if (
            holder_name is None
            or holder_name == self._actor.name
            or model is None
            or not cache.enabled
            or request.has_images
            or request.prompt_logprobs is not None
            or request.request_id in self._ready
        ):
            return False
        holder = self._holder(holder_name)
        if holder is None:
            return False
        block_size = self._kv.block_size
        keys = prompt_keys(request, model_identity(model), block_size)
        limit = min(request.pull_blocks, (request.prompt_tokens - 1) // block_size)
        reserved = reserve_pull(cache, request.request_id, keys, limit)
        if reserved is None:
            return False
        own, landing = reserved
        request.pull_started()
        self._actor.spawn(self._pull, request, holder, keys[:limit], own, landing)
        return True

    def landed(self, request_id: str) -> tuple[list[int], str | None] | None:
        """What `take` would give now, nothing taken (a batch plan's input)."""
        return self._ready.get(request_id)

    def take(self, request_id: str) -> tuple[list[int], str | None] | None:
        """The blocks a pulled request's prompt starts with (its borrowing) and the replica they were
        pulled from (None: the pull failed, they are this replica's own), or None when it did not pull;
        the caller owns the blocks from now on (`KVCache.release`)."""
        return self._ready.pop(request_id, None)

    def drop(self, request_id: str) -> None:
        """`request_id` leaves this replica before its prompt ran: its borrowed prefix goes back."""
        ready = self._ready.pop(request_id, None)
        if ready is not None:
            self._kv.release(ready[0], request_id)

    def _holder(self, name: str) -> PeerReplica | None:
        local = self._directory.get(name)
        if local is not None:
            return local
        return next((peer for peer in self._directory.remote() if peer.name == name), None)

    async def _pull(
        self,
        request: ServingRequest,
        holder: PeerReplica,
        keys: list[bytes],
        own: list[int],
        landing: list[int],
    ) -> None:
        """Ask `holder` for the blocks after `own` and receive them into `landing`; the outcome goes to
        the main loop whatever happens (cancellation included: the transfer's own cleanup has run)."""
        block_size = self._kv.block_size
        transfer_id = f"{request.request_id}/pull{next(_pull_numbers)}"
        source, destination = holder.name, self._actor.name
        log = self._actor.log.bind(request_id=request.request_id)
        transport = self._fabric.kind
        started = time.monotonic()
        landed = 0
        nbytes, rounds = 0, 0
        reason: str | None = FailureReason.ABORTED.value
        try:
            with request.work_scope():
                try:
                    link = await self._fabric.link(self._endpoint, f"{holder.name}/kv")
                    command = SendCachedKV(
                        command_id=new_command_id(), transfer_id=transfer_id, keys=keys, start=len(own)
                    )
                    timeout = self._settings.kv_transfer.handshake_timeout
                    sending = min(int(await holder.ask(command, timeout=timeout)), len(landing))
                    log.emit(
                        TransferStarted(
                            kind="pull",
                            transfer_id=transfer_id,
                            source=source,
                            destination=destination,
                            transport=transport,
                            total_tokens=sending * block_size,
                            granted_blocks=sending,
                        )
                    )
                    result = await self._endpoint.receive(
                        transfer_id,
                        peer=link,
                        blocks=landing[:sending],
                        expected_tokens=sending * block_size,
                    )
                    landed, reason = sending, None
                    nbytes, rounds = result.report.bytes, result.report.rounds
                except TransferError as exc:
                    reason = exc.reason.value
                    nbytes, rounds = exc.report.bytes, exc.report.rounds
                except CommandRefused as exc:
                    reason = f"refused: {exc.code}"
                except (LinkError, HandshakeRefused, UnknownEndpoint):
                    reason = FailureReason.LINK_LOST.value
        finally:
            log.emit(
                TransferFinished(
                    kind="pull",
                    transfer_id=transfer_id,
                    status="success" if reason is None else "failed",
                    reason=reason,
                    rounds=rounds,
                    tokens=landed * block_size,
                    bytes=nbytes if reason is None else 0,
                    seconds=time.monotonic() - started,
                    source=source,
                    destination=destination,
                    transport=transport,
                )
            )
            if reason is None:
                self._fabric.count_bytes(source, destination, "pull", nbytes)
            self._actor.later(lambda: self._landed(request, holder.name, own, landing, landed))

    def _landed(
        self, request: ServingRequest, holder: str, own: list[int], landing: list[int], landed: int
    ) -> None:
        """The pull ended with `landed` blocks (main loop): they join this replica's cache after the
        borrowed `own`; the rest of `landing` goes back to the pool; the prompt may run."""
        request.pull_ended()
        table = land_pull(self._kv.prefix, request.request_id, own, landing, landed)
        self._ready[request.request_id] = (table, holder if landed else None)
        self._ended(request)
        self._actor.post()


def lend(
    actor: Actor, kv: KVCache, endpoint: TransferEndpoint, command: SendCachedKV, block_size: int
) -> int:
    """The holder's side of a pull (main loop): borrow the chain of `command.keys` this replica's cache
    holds, send its blocks from `command.start` on as transfer `command.transfer_id`, release the
    borrowing when the send ends. Returns the number of blocks sent; raises `CommandRefused`
    (`not_found`) when it holds none after `start`."""
    owner = f"lend:{command.transfer_id}"
    blocks, sending = borrow_chain(kv.prefix, owner, command.keys, command.start)
    if not sending:
        raise CommandRefused(
            "not_found",
            f"{actor.name} holds no cached block of that prefix after block {command.start} of "
            f"{len(command.keys)} (evicted, or never cached here)",
        )

    async def send() -> None:
        try:
            async with endpoint.open_send(command.transfer_id) as session:
                await session.send(sending, total_tokens=len(sending) * block_size)
        except TransferError:
            pass  # the receiving replica computes the prefix instead; it logs the transfer's reason
        finally:
            actor.later(lambda: kv.release(blocks, owner))

    actor.spawn(send)
    return len(sending)


# ---------------------------------------------------------------------- the cache's side (pure)
def reserve_pull(
    cache: PrefixCache, owner: str, keys: Sequence[bytes], limit: int
) -> tuple[list[int], list[int]] | None:
    """The receiver before a pull of `keys[:limit]`: borrow the prefix `cache` holds (for `owner`, who
    may publish the rest later) and allocate blocks for the others under `owner`. None (nothing
    borrowed or allocated) when it holds them all, or the pool has no room."""
    own_count = cache.match(keys[:limit])
    if own_count >= limit:
        return None
    own = cache.acquire(owner, keys, limit=own_count)
    landing = cache.pool.try_allocate(limit - len(own), owner)
    if landing is None:  # no room now: computing needs the blocks anyway
        cache.release(owner, own)
        return None
    return own, landing


def land_pull(cache: PrefixCache, owner: str, own: list[int], landing: list[int], landed: int) -> list[int]:
    """The receiver after a pull: the first `landed` blocks of `landing` hold the KV (the transfer's
    fence passed), the rest go back to the pool; what landed joins the cache after `own` (as far as
    `publish` takes it). Returns the blocks the prompt starts with, still borrowed by `owner`."""
    cache.pool.free(landing[landed:], owner)
    table = own + landing[:landed]
    if landed:
        cache.publish(owner, table)
    return table


def borrow_chain(
    cache: PrefixCache, owner: str, keys: Sequence[bytes], start: int
) -> tuple[list[int], list[int]]:
    """The holder: borrow (for `owner`) the chain of `keys` `cache` holds; returns it and its blocks
    from `start` on (to send). Nothing to send: nothing stays borrowed. `cache.release(owner, blocks)`
    ends the borrowing."""
    blocks = cache.acquire(owner, keys, limit=len(keys)) if cache.enabled else []
    if len(blocks) <= start:
        if blocks:
            cache.release(owner, blocks)
        return [], []
    return blocks, blocks[start:]
