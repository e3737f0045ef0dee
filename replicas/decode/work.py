"""Decode behaviour: take migrated KV, step the batch, stream tokens, free finished sequences.

Growth policy (documented in docs/serving.md): a decode replica reserves, all-or-nothing, the blocks a
request can ever need — prompt + `max_tokens` − 1 tokens, capped by the context — when it accepts the
migration (`reserve`). The prompt's KV lands in the first blocks of that reservation (no copy on
arrival: the granted blocks *are* the cache); generation grows into the rest. Nothing is allocated
while decoding, so decoding never deadlocks on blocks and never truncates.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, final

import trio

from messages.commands import ReserveKV
from messages.control_replies import TransferSummary
from messages.faults import CorruptTransfer
from messages.log.events import FaultInjected
from replicas.decode.receive import KVPart, KVReceived, receive_kv_part
from replicas.inbox import CommandRefused, Completed
from replicas.model import DecodeResult, DecodeSequence, ModelInputError, finish_reason
from replicas.prefill.work import Prefilled
from replicas.request import ServingRequest
from replicas.states import ReplicaState
from transport.errors import TransferError

if TYPE_CHECKING:
    from replicas.actor import Replica
    from replicas.roles import RoleWork

S = ReplicaState


@final
@dataclass(slots=True)
class DecodeSlot:
    """A request decoding here; `table` is its whole reservation (owner: the request id)."""

    request: ServingRequest
    table: list[int]


@final
class DecodeWork:
    """The decode role of one replica (see the module docstring)."""

    def __init__(self, work: RoleWork) -> None:
        self.work = work
        self.running: list[DecodeSlot] = []
        self.arrived: deque[DecodeSlot] = deque()
        self.incoming: dict[str, DecodeSlot] = {}
        self.stepping: list[DecodeSlot] = []

    @property
    def replica(self) -> Replica:
        return self.work.replica

    @property
    def queued(self) -> int:
        return len(self.arrived) + len(self.incoming)

    @property
    def idle(self) -> bool:
        return not self.running and not self.arrived and not self.incoming

    # ------------------------------------------------------------------ migrations in
    def reserve(self, command: ReserveKV) -> str:
        """Accept (and start receiving) or refuse a migration; see the module docstring."""
        replica = self.replica
        kv = replica.pools.kv
        if replica.state is not S.DECODE or kv is None:
            raise CommandRefused("overloaded", f"{replica.name} is {replica.state.value}, not Decode")
        if replica.lock_reasons:
            raise CommandRefused(
                "overloaded", f"{replica.name} is locked ({', '.join(sorted(replica.lock_reasons))})"
            )
        request = replica.services.requests.get(command.request_id)
        if request is None or request.ended or request.cancelled:
            raise CommandRefused("not_found", f"request {command.request_id} is not live")
        table = kv.pool.try_allocate(kv.blocks_for(command.capacity_tokens), command.request_id)
        if table is None:
            raise CommandRefused(
                "overloaded",
                f"{replica.name}: {kv.blocks_for(command.capacity_tokens)} KV blocks needed, "
                f"{kv.pool.free_blocks} free",
            )
        sequence = DecodeSlot(request, table)
        request.holder = replica.name
        self.incoming[command.request_id] = sequence
        self.work.spawn(self._receive, sequence, command)
        return "accepted"

    async def _receive(self, sequence: DecodeSlot, command: ReserveKV) -> None:
        """Receive the prompt's KV — one transfer, or a ZigZag request's two halves at once (a failed
        half aborts the other) — then let the main loop adopt or fail the request."""
        num_layers = self.replica.services.host.config.num_layers
        halves = [KVPart(command.transfer_id, command.source_endpoint, command.layers or (0, num_layers))]
        if command.other_half is not None:
            other = command.other_half
            halves.append(KVPart(other.transfer_id, other.source_endpoint, (other.start, other.stop)))
        outcomes: list[KVReceived] = []
        async with trio.open_nursery() as nursery:

            async def one(part: KVPart) -> None:
                received = await receive_kv_part(
                    self.replica, sequence.request, sequence.table, command, part
                )
                outcomes.append(received)
                if received.error is not None or received.report is None:
                    nursery.cancel_scope.cancel()  # the request cannot decode: stop the other half

            for part in halves:
                nursery.start_soon(one, part)
        self.replica.post(Completed(lambda _: self._landed(sequence, command, outcomes)))

    def _landed(self, sequence: DecodeSlot, command: ReserveKV, outcomes: list[KVReceived]) -> None:
        request = sequence.request
        self.incoming.pop(request.request_id, None)
        kv = self.replica.pools.kv
        assert kv is not None
        complete = len(outcomes) == (2 if command.other_half is not None else 1)
        failed = next((o for o in outcomes if o.error is not None), None)
        if (
            failed is not None
            or not complete
            or any(o.report is None for o in outcomes)
            or request.cancelled
            or request.ended
        ):
            kv.pool.free(sequence.table, request.request_id)
            outcome = None if failed is None else failed.error
            if request.cancelled or outcome is None:  # a cancel aborts the transfer: no failure
                request.finish("cancelled")
            elif isinstance(outcome, TransferError):
                request.fail(outcome.code, f"KV migration of request {request.request_id} failed: {outcome}")  # type: ignore[arg-type]
            else:
                request.fail(
                    "transfer_failed", f"KV migration of request {request.request_id} failed: {outcome}"
                )
            return
        request.stamps.kv_finished = time.time()
        for received in sorted(outcomes, key=lambda o: o.part.layers):
            report = received.report
            assert report is not None
            request.transfers.append(
                TransferSummary(
                    kind="kv",
                    transfer_id=received.part.transfer_id,
                    source=received.source,
                    destination=self.replica.name,
                    rounds=report.rounds,
                    bytes=report.bytes,
                    seconds=report.seconds,
                    transport=self.replica.services.fabric.kind,
                    layers=list(received.part.layers),
                )
            )
        self._maybe_corrupt(sequence, command)
        self.arrived.append(sequence)

    def _maybe_corrupt(self, sequence: DecodeSlot, command: ReserveKV) -> None:
        """The `corrupt_transfer` fault hook: alter the landed K of layer 0 (the output must change).

        `nth` counts the KV transfers that landed on this node, from 0, in the order they finished."""
        landed = self.replica.services.transfers_landed
        index = landed["kv"]
        landed["kv"] += 1
        hit = any(
            isinstance(fault, CorruptTransfer) and fault.transfer == "kv" and fault.nth in (None, index)
            for fault in self.replica.services.faults
        )
        if not hit:
            return
        kv = self.replica.pools.kv
        assert kv is not None
        rows = kv.slot_rows(sequence.table, 0, command.prompt_tokens)
        keys = kv.keys(0)
        keys.index_copy_(0, rows, -keys.index_select(0, rows) * 3.0 + 1.0)
        self.replica.log.emit(
            FaultInjected(
                fault="corrupt_transfer",
                detail=f"kv transfer {command.transfer_id} of request {command.request_id} altered "
                f"(kv transfer {index} of the node, received by {self.replica.name})",
            )
        )

    def adopt_local(self, items: list[Prefilled]) -> int:
        """Flush: take this replica's own prefilled requests (KV already here), growing their tables."""
        kv = self.replica.pools.kv
        assert kv is not None
        context = self.work.context_length
        for item in items:
            request = item.request
            need = kv.blocks_for(request.kv_capacity_tokens(context)) - len(item.table)
            extra = kv.pool.try_allocate(max(0, need), request.request_id)
            if extra is None:
                kv.pool.free(item.table, request.request_id)
                request.fail(
                    "overloaded",
                    f"{self.replica.name}: no KV room to decode request {request.request_id} here",
                )
                continue
            request.holder = self.replica.name
            self.arrived.append(DecodeSlot(request, [*item.table, *extra]))
        return len(items)

    def adopt_arrivals(self) -> None:
        while self.arrived:
            self.running.append(self.arrived.popleft())

    # ------------------------------------------------------------------ a step
    def start_step(self) -> None:
        executor = self.work.executor
        if executor is None:
            return
        self._drop_cancelled()
        if not self.running:
            return
        batch = self.running[: self.replica.services.settings.max_batch_size]
        sequences = [
            DecodeSequence(
                block_table=s.table,
                cached_tokens=s.request.context_tokens,
                token_id=s.request.generated[-1],
                position=s.request.decode_position(),
                sampling=s.request.sampling,
            )
            for s in batch
        ]
        self.stepping = batch
        emulated = self.replica.services.settings.emulated.decode_seconds()
        self.work.compute(lambda: executor.decode(sequences), self._stepped, emulated=emulated)

    def _drop_cancelled(self) -> None:
        for sequence in [s for s in self.running if s.request.cancelled]:
            self.running.remove(sequence)
            self._free(sequence)
            sequence.request.finish("cancelled")

    def _stepped(self, result: DecodeResult | ModelInputError) -> None:
        batch, self.stepping = self.stepping, []
        if isinstance(result, ModelInputError):
            for sequence in batch:
                self.running.remove(sequence)
                self._free(sequence)
                sequence.request.fail("internal", f"decode step refused its inputs: {result}")
            return
        context = self.work.context_length
        for sequence, token in zip(batch, result.tokens, strict=True):
            request = sequence.request
            if request.cancelled:
                continue  # dropped at the next step
            request.generated.append(token)
            request.emit_tokens([token])
            reason = finish_reason(
                request.generated, request.sampling, request.eos_token_ids, request.max_tokens
            )
            if reason is None and request.context_tokens + 1 > context:
                reason = "length"
            if reason is not None:
                self.running.remove(sequence)
                self._free(sequence)
                request.finish(reason)
        # Rotate so a batch larger than max_batch_size shares the steps fairly.
        stepped = {id(s) for s in batch}
        self.running = [s for s in self.running if id(s) not in stepped] + [
            s for s in self.running if id(s) in stepped
        ]

    def _free(self, sequence: DecodeSlot) -> None:
        kv = self.replica.pools.kv
        assert kv is not None
        kv.pool.free(sequence.table, sequence.request.request_id)

    def held_tables(self) -> list[DecodeSlot]:
        return [*self.running, *self.arrived, *self.incoming.values()]
