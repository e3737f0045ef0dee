"""Decode behaviour: take migrated KV, step the batch, stream tokens, free finished sequences.

Growth policy (documented in docs/serving.md): a decode replica reserves, all-or-nothing, the blocks a
request can ever need — prompt + `max_tokens` − 1 tokens, capped by the context — when it accepts the
migration (`reserve`). The prompt's KV lands in the first blocks of that reservation (no copy on
arrival: the granted blocks *are* the cache); generation grows into the rest. Nothing is allocated
while decoding, so decoding never deadlocks on blocks and never truncates.

Plan → execute → apply: `schedule` picks the step's sequences (the first `max_batch_size` running), the
step runs in a worker thread (`replicas.step.compute`), `replicas.step.apply.apply_tokens` appends each
token and releases the requests that ended (a turn that ended normally keeps its full blocks — prompt and
answer — in the replica's prefix cache, `_ended`: the next turn's prefix, which a prefill replica can
pull from here); the batch then rotates, so a batch larger than
`max_batch_size` shares the steps fairly. A step the model refuses fails its requests (`internal`).

Whether the replica may take a migration at all (its state, its lock) is the actor's to check before
`reserve` is asked.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import final

import trio

from messages.commands import ReserveKV
from messages.control_replies import TransferSummary
from replicas.decode.receive import KVLanding, KVPart, KVReceived, receive_kv_part
from replicas.faults import FaultHooks
from replicas.inbox import CommandRefused
from replicas.model import DecodeResult, DecodeSequence, ModelInputError, token_history
from replicas.ports import Actor, LiveRequests
from replicas.prefill.prefix import model_identity
from replicas.settings import ReplicaSettings
from replicas.step.apply import apply_tokens, refuse
from replicas.step.compute import Compute
from replicas.step.grammar import grammar_rows
from replicas.step.plan import DecodeCall, Held
from transport.errors import TransferError
from transport.memory.prefix_cache import block_keys


def schedule(running: Sequence[Held], max_batch_size: int) -> list[Held]:
    """The sequences of the next step: the first `max_batch_size` running (the batch rotates)."""
    return list(running[:max_batch_size])


@final
class DecodeWork:
    """The decode role of one replica (see the module docstring); KV lands at `landing`; `changed` tells
    the node when blocks went back to the pool."""

    def __init__(
        self,
        actor: Actor,
        *,
        landing: KVLanding,
        settings: ReplicaSettings,
        compute: Compute,
        requests: LiveRequests,
        faults: FaultHooks,
        changed: Callable[[], None],
    ) -> None:
        self._actor = actor
        self._landing = landing
        self._kv = landing.kv
        self._settings = settings
        self._compute = compute
        self._requests = requests
        self._faults = faults
        self._changed = changed
        self.running: list[Held] = []
        self.arrived: deque[Held] = deque()
        self.incoming: dict[str, Held] = {}
        self.stepping: list[Held] = []

    @property
    def queued(self) -> int:
        return len(self.arrived) + len(self.incoming)

    @property
    def idle(self) -> bool:
        return not self.running and not self.arrived and not self.incoming

    # ------------------------------------------------------------------ migrations in
    def reserve(self, command: ReserveKV) -> str:
        """Accept (and start receiving) or refuse a migration; see the module docstring."""
        kv, name = self._kv, self._actor.name
        request = self._requests.get(command.request_id)
        if request is None or request.ended or request.cancelled:
            raise CommandRefused("not_found", f"request {command.request_id} is not live")
        table = kv.pool.try_allocate(kv.blocks_for(command.capacity_tokens), command.request_id)
        if table is None:
            raise CommandRefused(
                "overloaded",
                f"{name}: {kv.blocks_for(command.capacity_tokens)} KV blocks needed, "
                f"{kv.pool.available_blocks} available",
            )
        held = Held(request, table)
        request.hand_to(name)
        self.incoming[command.request_id] = held
        self._actor.spawn(self._receive, held, command)
        return "accepted"

    async def _receive(self, held: Held, command: ReserveKV) -> None:
        """Receive the prompt's KV — one transfer, or a ZigZag request's two halves at once (a failed
        half aborts the other) — then let the main loop adopt or fail the request."""
        num_layers = self._landing.num_layers
        halves = [KVPart(command.transfer_id, command.source_endpoint, command.layers or (0, num_layers))]
        if command.other_half is not None:
            other = command.other_half
            halves.append(KVPart(other.transfer_id, other.source_endpoint, (other.start, other.stop)))
        outcomes: list[KVReceived] = []
        async with trio.open_nursery() as nursery:

            async def one(part: KVPart) -> None:
                received = await receive_kv_part(self._landing, held.request, held.table, command, part)
                outcomes.append(received)
                if received.error is not None or received.report is None:
                    nursery.cancel_scope.cancel()  # the request cannot decode: stop the other half

            for part in halves:
                nursery.start_soon(one, part)
        self._actor.later(lambda: self._landed(held, command, outcomes))

    def _landed(self, held: Held, command: ReserveKV, outcomes: list[KVReceived]) -> None:
        request = held.request
        self.incoming.pop(request.request_id, None)
        complete = len(outcomes) == (2 if command.other_half is not None else 1)
        failed = next((o for o in outcomes if o.error is not None), None)
        if (
            failed is not None
            or not complete
            or any(o.report is None for o in outcomes)
            or request.cancelled
            or request.ended
        ):
            self._free(held)
            outcome = None if failed is None else failed.error
            if request.cancelled or outcome is None:  # a cancel aborts the transfer: no failure
                request.finish("cancelled")
            elif isinstance(outcome, TransferError):
                request.fail(outcome.code, f"KV migration of request {request.request_id} failed: {outcome}")
            else:
                request.fail(
                    "transfer_failed", f"KV migration of request {request.request_id} failed: {outcome}"
                )
            return
        request.stamp("kv_finished")
        for received in sorted(outcomes, key=lambda o: o.part.layers):
            report = received.report
            assert report is not None
            request.transfers.append(
                TransferSummary(
                    kind="kv",
                    transfer_id=received.part.transfer_id,
                    source=received.source,
                    destination=self._actor.name,
                    rounds=report.rounds,
                    bytes=report.bytes,
                    seconds=report.seconds,
                    transport=self._landing.fabric.kind,
                    layers=list(received.part.layers),
                )
            )
        self._faults.corrupt_landed_kv(
            self._actor.log,
            self._kv,
            held.table,
            command.prompt_tokens,
            transfer_id=command.transfer_id,
            request_id=command.request_id,
            replica=self._actor.name,
        )
        self.arrived.append(held)

    def adopt_local(self, items: list[Held]) -> int:
        """Flush: take this replica's own prefilled requests (KV already here), growing their tables."""
        kv = self._kv
        context = self._compute.context_length
        for item in items:
            request = item.request
            need = kv.blocks_for(request.kv_capacity_tokens(context)) - len(item.table)
            extra = kv.pool.try_allocate(max(0, need), request.request_id)
            if extra is None:
                kv.release(item.table, request.request_id)
                request.fail(
                    "overloaded",
                    f"{self._actor.name}: no KV room to decode request {request.request_id} here",
                )
                continue
            request.hand_to(self._actor.name)
            self.arrived.append(Held(request, [*item.table, *extra]))
        return len(items)

    def adopt_arrivals(self) -> None:
        while self.arrived:
            self.running.append(self.arrived.popleft())

    # ------------------------------------------------------------------ a step
    def start_step(self) -> None:
        """Plan, execute and apply the next step (main loop, no compute running)."""
        executor = self._compute.executor
        if executor is None:
            return
        self._drop_cancelled()
        batch = schedule(self.running, self._settings.max_batch_size)
        if not batch:
            return
        call = DecodeCall(
            [
                DecodeSequence(
                    block_table=s.table,
                    cached_tokens=s.request.context_tokens,
                    token_id=s.request.generated[-1],
                    position=s.request.decode_position(),
                    sampling=s.request.sampling,
                    logprobs=s.request.logprobs,
                    history=token_history(s.request.sampling, s.request.token_ids, s.request.generated),
                )
                for s in batch
            ],
            grammars=grammar_rows([s.request for s in batch]),
        )
        self.stepping = batch
        self._compute.run(
            lambda: call.run(executor), self._stepped, self._refused, emulated=self._compute.emulated_decode()
        )

    def _drop_cancelled(self) -> None:
        for held in [s for s in self.running if s.request.cancelled]:
            self.running.remove(held)
            self._free(held)
            held.request.finish("cancelled")

    def _stepped(self, result: DecodeResult) -> None:
        batch, self.stepping = self.stepping, []
        going_on = apply_tokens(
            batch,
            result.tokens,
            context_length=self._compute.context_length,
            release=self._ended,
            log=self._actor.log,
            logprobs=result.logprobs,
        )
        # Rotate: the ones that stepped and go on move to the back (the others ended and were freed).
        stepped = {id(s) for s in batch}
        self.running = [s for s in self.running if id(s) not in stepped] + going_on

    def _refused(self, error: ModelInputError) -> None:
        batch, self.stepping = self.stepping, []
        stepped = {id(s) for s in batch}
        self.running = [s for s in self.running if id(s) not in stepped]
        refuse(batch, code="internal", message=f"decode step refused its inputs: {error}", release=self._free)

    def _ended(self, held: Held) -> None:
        """A step ended `held` (released before it finishes): a turn that ended normally keeps its full
        blocks, prompt and answer, in the prefix cache (the next turn's prefix: docs/prefix-cache.md);
        a cancelled one, one a stop string ended, frees them."""
        request, model = held.request, self._compute.model
        cache = self._kv.prefix
        if (
            not cache.enabled
            or model is None
            or request.cancelled
            or request.ended
            or request.has_images  # its keys cover image digests this replica does not have
            or request.relay is not None  # as a relayed prefill's blocks, a ZigZag request's are not kept
        ):
            self._free(held)
            return
        # The KV written: the prompt and every generated token but the newest (never fed back).
        tokens = [*request.token_ids, *request.generated[:-1]]
        cache.keep(
            request.request_id, block_keys(model_identity(model), tokens, cache.pool.block_size), held.table
        )
        self._changed()

    def _free(self, held: Held) -> None:
        """Blocks back to the pool: room for another migration (a migration queue waiting for it hears)."""
        self._kv.release(held.table, held.request.request_id)
        self._changed()

    def held(self) -> list[Held]:
        return [*self.running, *self.arrived, *self.incoming.values()]
