"""The NewPrefill side of ZigZag (architecture §8): serve with the layers that have landed, hand the rest over.

While its weights arrive, a `NewPrefill` replica takes prompts from the router while it has spare
compute (`limits`), runs each through the layers it has (KV of those layers lands in its own blocks)
and, as more layers land, through those too. Its OldPrefill partner asks for work (`Relay`): it hands
over its oldest batch that is not computing, at the layer boundary `n` it reached — hidden states and
positions as a relay transfer, the request facts in the `RelayOffer` — and keeps each request's KV of
layers `[0, n)` (a *half*) until the decode replica chosen by the partner takes it (`SendKVHalf`) or the
request ends (`DropKVHalf`, or its end hook). When loading finishes the replica turns
`RefractoryPrefill`: it gives its unbatched requests back to the router, finishes its batches with every
layer (or hands them over when asked) and then serves as a plain `Prefill` replica.

Invariants: a batch is computing, held here, or handed over — never two; a half is freed exactly once
(sent, dropped, or its request ended). Runs in the replica's main loop; transfers in helper tasks.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import final

import torch

from messages.commands import Relay, RelayedRequest, RelayHint, RelayOffer, SendKVHalf
from messages.control_replies import RelayInfo
from messages.log.events import RelayHandedOver
from replicas.fabric import Fabric
from replicas.inbox import CommandRefused, new_command_id
from replicas.model import KVCache, ModelInputError, PrefillResult, PrefillSequence
from replicas.ports import Actor, Directory, tell_peer
from replicas.prefill.work import PrefillWork
from replicas.request import ServingRequest
from replicas.settings import ReplicaSettings
from replicas.states import ReplicaState
from replicas.step.apply import refuse
from replicas.step.compute import Compute
from replicas.step.grammar import grammar_rows
from replicas.step.plan import Held, PrefillCall
from replicas.zigzag import wire
from replicas.zigzag.limits import prompt_room
from transport.endpoint import TransferEndpoint
from transport.errors import TransferError

S = ReplicaState
_batch_numbers = itertools.count(1)


@final
@dataclass(slots=True)
class PartBatch:
    """A batch part-way through the model: `hidden` is the output of layers `[0, reached)`."""

    batch_id: str
    items: list[Held]
    sequences: list[PrefillSequence]
    hidden: torch.Tensor | None = None
    reached: int = -1  # -1: not even embedded yet
    computing: bool = False

    @property
    def tokens(self) -> int:
        return sum(item.request.prompt_tokens for item in self.items)


def schedule(
    batches: Sequence[PartBatch], *, loaded: int, whole: bool, forming: bool
) -> list[PartBatch | None]:
    """The steps a NewPrefill replica may take next, best first (None: form a new batch from the queue);
    pure. The oldest batch first when it can advance (it is the next one handed over); else a new batch
    while the replica still forms them (`forming`: NewPrefill, loading not finished), so arrivals are not
    held behind older batches; else the oldest batch that can advance. A batch can advance when it is
    not computing and layers it has not run have landed (`loaded`), or — the model `whole` — it has run
    them all and only the head is left."""

    def can_advance(batch: PartBatch) -> bool:
        return not batch.computing and (batch.reached < loaded or (whole and batch.reached == loaded))

    advancing = [batch for batch in batches if can_advance(batch)]
    if advancing and advancing[0] is batches[0]:
        return [advancing[0]]
    return ([None] if forming else []) + advancing[:1]


@final
@dataclass(slots=True)
class Half:
    """A relayed request's KV of layers `[0, request.relay.layer)` in this replica's blocks."""

    item: Held
    sending: bool = False


@final
class NewPrefillWork:
    """See the module docstring. Its batches come from the replica's `prefill` queue and finish through
    it; halves live in `kv`, sent from `kv_endpoint`; relays leave from `relay_endpoint`."""

    def __init__(
        self,
        actor: Actor,
        *,
        prefill: PrefillWork,
        kv: KVCache,
        kv_endpoint: TransferEndpoint,
        relay_endpoint: TransferEndpoint,
        fabric: Fabric,
        settings: ReplicaSettings,
        compute: Compute,
        directory: Directory,
        changed: Callable[[], None],
    ) -> None:
        self._actor = actor
        self._prefill = prefill
        self._kv = kv
        self._kv_endpoint = kv_endpoint
        self._relay_endpoint = relay_endpoint
        self._fabric = fabric
        self._settings = settings
        self._compute = compute
        self._directory = directory
        self._changed = changed
        self.batches: deque[PartBatch] = deque()
        self.halves: dict[str, Half] = {}
        self.partners: list[str] = []

    @property
    def idle(self) -> bool:
        return not self.batches

    def entered(self, paired_with: str | None) -> None:
        if paired_with is not None:
            self.add_partner(paired_with)

    def add_partner(self, name: str) -> None:
        if name not in self.partners:
            self.partners.append(name)

    def prompt_limit(self) -> int:
        """The longest prompt the router may hand this NewPrefill now; negative: it takes none (see
        `limits`: while its spare compute lasts; a prompt longer than a batch runs alone on a serving
        replica — the relay pool holds a batch)."""
        model = self._compute.model
        if self._actor.state is not S.NEW_PREFILL or self._compute.executor is None or model is None:
            return -1
        return prompt_room(
            budget=self._settings.max_batch_tokens,
            loaded=model.loaded_layers,
            queued_tokens=self._prefill.queue.tokens,
            batches=[(batch.tokens, batch.reached) for batch in self.batches],
        )

    # ------------------------------------------------------------------ compute
    def start_next(self) -> None:
        """Plan, execute and apply the next compute (main loop, not busy): the first step `schedule`
        names that can start — a batch to advance as far as the layers landed, or a new batch formed
        from the queue."""
        model, executor = self._compute.model, self._compute.executor
        if model is None or executor is None:
            return
        self._drop_cancelled_batches()
        self._merge()
        loaded, whole = model.loaded_layers, model.fully_loaded
        forming = self._actor.state is S.NEW_PREFILL and not whole
        for step in schedule(self.batches, loaded=loaded, whole=whole, forming=forming):
            if step is None:
                formed = self._form_batch()
                if formed is None:
                    continue  # no request ready or fitting: the next step
                self._run(formed, 0, loaded, head=False)
            else:
                self._run(step, max(step.reached, 0), loaded, head=whole)
            return

    def _form_batch(self) -> PartBatch | None:
        plan = self._prefill.plan(chunked=False, cached=False)  # its layers run in two places
        if not plan:
            return None
        taken = self._prefill.execute(plan)
        batch = PartBatch(
            f"{self._actor.name}/b{next(_batch_numbers)}", list(taken.items), list(taken.sequences)
        )
        self.batches.append(batch)
        return batch

    def _run(self, batch: PartBatch, start: int, stop: int, *, head: bool) -> None:
        """Plan layers `[start, stop)` of `batch` (and the head when `head`), execute, apply (`_ran`)."""
        executor = self._compute.executor
        assert executor is not None  # `start_next` checked it
        batch.computing = True
        grammars = grammar_rows([item.request for item in batch.items]) if head else ()
        call = PrefillCall(
            batch.sequences, layers=range(start, stop), hidden=batch.hidden, head=head, grammars=grammars
        )
        self._compute.run(
            lambda: call.run(executor),
            lambda result: self._ran(batch, stop, result),
            lambda error: self._refused(batch, error),
            emulated=self._compute.emulated_prefill(batch.tokens, stop - start),
        )

    def _ran(self, batch: PartBatch, stop: int, result: PrefillResult) -> None:
        batch.computing = False
        if result.tokens is not None:  # every layer and the head: finished here
            self.batches.remove(batch)
            self._prefill.complete(batch.items, result)
            return
        batch.hidden, batch.reached = result.hidden, stop
        self._hint_partners()
        self._changed()  # its spare compute grew (`limits`): the router may hand more

    def _refused(self, batch: PartBatch, error: ModelInputError) -> None:
        batch.computing = False
        self.batches.remove(batch)
        refuse(batch.items, code="bad_request", message=str(error), release=self._free)

    def _free(self, item: Held) -> None:
        self._kv.release(item.table, item.request.request_id)

    def wake_partners(self) -> None:
        """Wake this node's partners to look at this replica's state; a partner on another node sees it
        in this node's next report (`OldPrefillWork.pair`)."""
        for name in self.partners:
            partner = self._directory.get(name)
            if partner is not None:
                partner.post()

    def _merge(self) -> None:
        """Neighbouring batches that reached the same layer (none computing) become one, oldest first,
        within the batch budget: the sequences are independent, so their hidden states just stack. A
        request that arrives while the replica is idle runs at once in a batch of its own; merged, such
        batches make fuller relays."""
        settings = self._settings
        merged: deque[PartBatch] = deque()
        for batch in self.batches:
            last = merged[-1] if merged else None
            if (
                last is not None
                and not (last.computing or batch.computing)
                and last.hidden is not None
                and batch.hidden is not None
                and last.reached == batch.reached
                and last.tokens + batch.tokens <= settings.max_batch_tokens
                and len(last.items) + len(batch.items) <= settings.max_batch_size
            ):
                last.items = [*last.items, *batch.items]
                last.sequences = [*last.sequences, *batch.sequences]
                last.hidden = torch.cat([last.hidden, batch.hidden])
                continue
            merged.append(batch)
        self.batches = merged

    def _hint_partners(self) -> None:
        ready = next((b for b in self.batches if not b.computing and b.hidden is not None), None)
        oldest = None
        if ready is not None:
            oldest = min(item.request.stamps.arrived for item in ready.items)
        for name in self.partners:
            hint = RelayHint(command_id=new_command_id(), new_prefill=self._actor.name, oldest=oldest)
            tell_peer(self._actor, self._directory, name, hint)

    def _drop_cancelled_batches(self) -> None:
        for batch in [b for b in self.batches if not b.computing]:
            if all(item.request.cancelled for item in batch.items):
                self.batches.remove(batch)
                for item in batch.items:
                    self._free(item)
                    item.request.finish("cancelled")

    # ------------------------------------------------------------------ handing over
    def offer(self, command: Relay) -> RelayOffer:
        """Hand the oldest batch that is not computing to `command.old_prefill` (see the docstring)."""
        name = self._actor.name
        # The oldest batch not computing: one running a layer now is handed over at its next boundary,
        # and the partner would otherwise sit idle meanwhile.
        candidates = [b for b in self.batches if not b.computing and b.hidden is not None]
        if not candidates:
            raise CommandRefused("not_found", f"{name} has no batch to hand over now")
        batch = candidates[0]
        if batch.tokens > command.room_tokens:
            raise CommandRefused(
                "overloaded",
                f"{name}: batch {batch.batch_id} has {batch.tokens} tokens, room for {command.room_tokens}",
            )
        assert batch.hidden is not None
        transfer_id = f"{batch.batch_id}/relay"
        staged = wire.stage(
            self._relay_endpoint, transfer_id, batch.hidden, wire.batch_positions(batch.sequences)
        )
        if staged is None:
            raise CommandRefused(
                "overloaded", f"{name}: no room in its relay pool for batch {batch.batch_id}"
            )
        self.batches.remove(batch)
        layer = batch.reached
        requests = []
        offset = 0
        for item in batch.items:
            request = item.request
            requests.append(
                RelayedRequest(
                    request_id=request.request_id, prompt_tokens=request.prompt_tokens, offset=offset
                )
            )
            offset += request.prompt_tokens
            request.hand_to(command.old_prefill)
            request.relay = RelayInfo(new_prefill=name, old_prefill=command.old_prefill, layer=layer)
            self._keep_half(item, layer)
        offer = RelayOffer(
            batch_id=batch.batch_id,
            transfer_id=transfer_id,
            source_endpoint=self._relay_endpoint.name,
            new_prefill=name,
            layer=layer,
            total_tokens=staged.tokens,
            requests=requests,
        )
        self._actor.log.emit(
            RelayHandedOver(
                batch_id=batch.batch_id,
                new_prefill=name,
                old_prefill=command.old_prefill,
                layer=layer,
                requests=len(requests),
                tokens=staged.tokens,
            )
        )
        self._actor.spawn(self._send, transfer_id, staged, command.old_prefill)
        self._hint_partners()  # the next batch in line, if any
        self._changed()  # room for another batch: the router may hand one
        return offer

    async def _send(self, transfer_id: str, staged: wire.Staged, destination: str) -> None:
        try:
            report = await wire.send_staged(self._relay_endpoint, transfer_id, staged)
        except TransferError:
            return  # the OldPrefill side fails the requests; the blocks are back in the pool
        self._fabric.count_bytes(self._actor.name, destination, "relay", report.bytes)

    def _keep_half(self, item: Held, layer: int) -> None:
        request = item.request
        if layer == 0:  # no KV computed here: nothing to keep
            self._free(item)
            return
        self.halves[request.request_id] = Half(item)

        def ended(_: ServingRequest) -> None:
            self._actor.later(lambda: self._drop(request.request_id))

        request.on_end.append(ended)

    def _drop(self, request_id: str) -> None:
        self.drop_half(request_id)

    def drop_half(self, request_id: str) -> int:
        """Free a request's half unless it is being sent (then `_sent` frees it). Returns blocks freed.
        (A part of an earlier run — the replica failed and restarted, its pools emptied — hears of
        nothing: the actor drops what it posts.)"""
        half = self.halves.get(request_id)
        if half is None or half.sending:
            return 0
        del self.halves[request_id]
        self._free(half.item)
        return len(half.item.table)

    def send_half(self, command: SendKVHalf) -> str:
        half = self.halves.get(command.request_id)
        if half is None:
            raise CommandRefused(
                "not_found", f"{self._actor.name} holds no KV half of request {command.request_id}"
            )
        if half.sending:
            raise CommandRefused(
                "bad_request",
                f"{self._actor.name}: the KV half of {command.request_id} is already being sent",
            )
        half.sending = True
        self._actor.spawn(self._send_half, half, command.transfer_id)
        return "sending"

    async def _send_half(self, half: Half, transfer_id: str) -> None:
        endpoint = self._kv_endpoint
        request = half.item.request
        with request.work_scope():
            try:
                async with endpoint.open_send(transfer_id) as session:
                    await session.send(half.item.table, total_tokens=request.prompt_tokens)
            except TransferError:
                pass  # the decode side fails the request with the transfer's reason
        self._actor.later(lambda: self._sent(half))

    def _sent(self, half: Half) -> None:
        half.sending = False
        self.drop_half(half.item.request.request_id)

    # ------------------------------------------------------------------ state changes
    def loading_finished(self) -> None:
        """NewPrefill → RefractoryPrefill: requests not yet in a batch go back to the router (before
        the move, whose readiness change dispatches them)."""
        self._prefill.return_queued("the replica finished loading and takes no new ZigZag batches")
