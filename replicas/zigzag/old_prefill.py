"""The OldPrefill side of ZigZag (architecture §8): finish the batches a NewPrefill partner began.

An `OldPrefill` replica keeps serving its own queue and, whenever it holds no relay, asks its partners
in turn for work (`Relay`, with the KV room it has). On an offer it reserves blocks for the batch's
prompts in its own KV pool, receives the hidden states (`wire.receive`) and — before any batch of its
own — runs layers `[n, L)`, the final norm and the head, and samples each first token; the requests then
migrate as usual, except that their KV travels in two halves (layers `[n, L)` from here, `[0, n)` from
the partner) into one reservation on one decode replica (`replicas.prefill.migration`). A partner that computed
a batch hints (`hint`) so the next ask is not a blind one. The replica returns to `Prefill` by itself
when no partner is still `NewPrefill` or `RefractoryPrefill` and no relay is in hand.

Cancellation: a relay being received is cancelled with the replica; its requests are held by this
replica (`holder`), so a failure of the replica fails them, and their halves on the partner are freed
by the requests' end hooks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, final

from messages.commands import DropKVHalf, Relay, RelayOffer
from messages.control_replies import RelayInfo, TransferSummary
from messages.log.events import RelayReceived
from replicas.fabric import UnknownEndpoint
from replicas.inbox import CommandRefused, Completed, new_command_id
from replicas.model import ModelInputError, PrefillResult, PrefillSequence
from replicas.prefill.work import Prefilled
from replicas.states import ZIGZAG_NEW, ReplicaState
from replicas.zigzag import wire
from transport.errors import HandshakeRefused, LinkError, TransferError

if TYPE_CHECKING:
    import torch

    from replicas.actor import Replica
    from replicas.roles import RoleWork

S = ReplicaState


@final
@dataclass(slots=True)
class IncomingRelay:
    offer: RelayOffer
    items: list[Prefilled]
    hidden: torch.Tensor | None = None
    positions: torch.Tensor | None = None


@final
class OldPrefillWork:
    """See the module docstring."""

    def __init__(self, work: RoleWork) -> None:
        self.work = work
        self.partners: list[str] = []
        self.asking = False
        self.hinted = True
        self.receiving: IncomingRelay | None = None
        self.ready: deque[IncomingRelay] = deque()
        self.running: IncomingRelay | None = None
        self.waiting: dict[str, float] = {}  # partner → arrival of the oldest request it would hand over

    @property
    def replica(self) -> Replica:
        return self.work.replica

    @property
    def in_hand(self) -> bool:
        """A relay is being asked for, received, waiting to run or running."""
        return self.asking or self.receiving is not None or bool(self.ready) or self.running is not None

    def pair(self, partner: str | None) -> None:
        if partner is not None and partner not in self.partners:
            self.partners.append(partner)
        self.hinted = True

    def hint(self, partner: str, oldest: float | None) -> None:
        """Partner `partner` holds a batch ready to hand over whose oldest request arrived at `oldest`
        (wall clock; None: it holds none now)."""
        if oldest is None:
            self.waiting.pop(partner, None)
        else:
            self.waiting[partner] = oldest
            self.hinted = True
        self.replica.post()

    def takes_new_work(self) -> bool:
        """Whether the router may queue new requests here: always with `old_prefill_serves_queue`;
        otherwise once no partner takes new work any more (the episode is ending)."""
        if self.replica.services.settings.old_prefill_serves_queue:
            return True
        replicas = self.replica.services.replicas
        return not any(p in replicas and replicas[p].state is S.NEW_PREFILL for p in self.partners)

    def relay_first(self) -> bool:
        """First come, first served across the two queues: ask for a relay unless this replica's own
        queue holds a ready request that arrived before every batch its partners hold (a partner that
        always has a batch ready would otherwise starve the own queue for the whole episode)."""
        own = next((r for r in self.work.prefill.queue if r.prompt_ready and not r.cancelled), None)
        if own is None or not self.waiting:
            return True
        return min(self.waiting.values()) <= own.stamps.arrived

    def live_partners(self) -> list[str]:
        replicas = self.replica.services.replicas
        self.partners = [p for p in self.partners if p in replicas and replicas[p].state in ZIGZAG_NEW]
        return self.partners

    def episode_over(self) -> bool:
        return not self.live_partners() and not self.in_hand

    # ------------------------------------------------------------------ asking
    def maybe_ask(self) -> None:
        if self.work.busy:
            return  # ask when free: the partner's batch has gone as far as it can by then
        if self.in_hand or not self.hinted or not self.live_partners() or not self.relay_first():
            return
        kv = self.replica.pools.kv
        assert kv is not None
        self.asking, self.hinted = True, False
        self.work.spawn(self._ask, list(self.partners), kv.pool.free_blocks * kv.block_size)

    async def _ask(self, partners: list[str], room_tokens: int) -> None:
        replicas = self.replica.services.replicas
        timeout = self.replica.services.settings.kv_transfer.handshake_timeout
        for name in partners:
            partner = replicas.get(name)
            if partner is None:
                continue
            command = Relay(
                command_id=new_command_id(), old_prefill=self.replica.name, room_tokens=room_tokens
            )
            try:
                offer = await partner.ask(command, timeout=timeout)
            except CommandRefused:
                continue
            self._post_accept(offer)
            return
        self.replica.post(Completed(lambda _: self._nothing()))

    def _post_accept(self, offer: RelayOffer) -> None:
        self.replica.post(Completed(lambda _: self._accept(offer)))

    def _nothing(self) -> None:
        self.asking = False

    def _accept(self, offer: RelayOffer) -> None:
        self.asking = False
        kv = self.replica.pools.kv
        assert kv is not None
        services = self.replica.services
        info = RelayInfo(new_prefill=offer.new_prefill, old_prefill=self.replica.name, layer=offer.layer)
        items: list[Prefilled] = []
        for relayed in offer.requests:
            request = services.requests.get(relayed.request_id)
            if request is None:
                continue  # ended meanwhile: its half on the partner went with it
            table = kv.pool.try_allocate(kv.blocks_for(relayed.prompt_tokens), relayed.request_id)
            if table is None:  # the room was announced in the ask; only a bug gets here
                request.fail(
                    "overloaded", f"{self.replica.name}: no KV room for relayed request {relayed.request_id}"
                )
                continue
            items.append(Prefilled(request, table, relay=info))
        incoming = IncomingRelay(offer, items)
        self.receiving = incoming
        self.work.spawn(self._receive, incoming)

    async def _receive(self, incoming: IncomingRelay) -> None:
        error: BaseException | None = None
        received: wire.Received | None = None
        try:
            received = await wire.receive(self.replica, incoming.offer)
        except (TransferError, LinkError, HandshakeRefused, UnknownEndpoint) as exc:
            error = exc
        self.replica.post(Completed(lambda _: self._received(incoming, received, error)))

    def _received(
        self, incoming: IncomingRelay, received: wire.Received | None, error: BaseException | None
    ) -> None:
        self.receiving = None
        offer = incoming.offer
        if received is None:
            code = error.code if isinstance(error, TransferError) else "transfer_failed"
            self._fail(
                incoming,
                code,
                f"the relay of batch {offer.batch_id} from {offer.new_prefill} failed: {error}",
            )
            return
        incoming.hidden, incoming.positions = received.hidden, received.positions
        report = received.report
        self.replica.services.fabric.count_bytes(offer.new_prefill, self.replica.name, "relay", report.bytes)
        for item in incoming.items:
            item.request.transfers.append(
                TransferSummary(
                    kind="relay",
                    transfer_id=offer.transfer_id,
                    source=offer.new_prefill,
                    destination=self.replica.name,
                    rounds=report.rounds,
                    bytes=report.bytes,
                    seconds=report.seconds,
                    transport=self.replica.services.fabric.kind,
                )
            )
        self.replica.log.emit(
            RelayReceived(
                batch_id=offer.batch_id,
                new_prefill=offer.new_prefill,
                old_prefill=self.replica.name,
                layer=offer.layer,
                bytes=received.report.bytes,
                seconds=received.report.seconds,
            )
        )
        self.ready.append(incoming)

    def release_half(self, item: Prefilled) -> None:
        """`item`'s request will not decode: its partner frees the KV of layers `[0, n)` it keeps (the
        request's end does too, where the partner sees it; this says so in a message)."""
        relay = item.relay
        partner = None if relay is None else self.replica.services.replicas.get(relay.new_prefill)
        if relay is not None and relay.layer > 0 and partner is not None:
            partner.tell(DropKVHalf(command_id=new_command_id(), request_id=item.request.request_id))

    def _fail(self, incoming: IncomingRelay, code: str, message: str) -> None:
        kv = self.replica.pools.kv
        assert kv is not None
        for item in incoming.items:
            self.release_half(item)
            kv.pool.free(item.table, item.request.request_id)
            if item.request.cancelled:
                item.request.finish("cancelled")
            else:
                item.request.fail(code, message)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ compute
    def start_next(self) -> bool:
        """Run the oldest received relay (main loop, not busy); False when there is none."""
        if not self.ready or self.work.executor is None:
            return False
        incoming = self.ready.popleft()
        kv = self.replica.pools.kv
        assert kv is not None
        live = []
        for item in incoming.items:
            if item.request.ended or item.request.cancelled:
                self.release_half(item)
                kv.pool.free(item.table, item.request.request_id)
                if not item.request.ended:
                    item.request.finish("cancelled")
            else:
                live.append(item)
        offsets = {r.request_id: r.offset for r in incoming.offer.requests}
        assert incoming.hidden is not None and incoming.positions is not None
        if not live:
            return False
        three_d = self.replica.services.host.config.position_axes == 3
        rows: list[int] = []
        sequences: list[PrefillSequence] = []
        for item in live:
            request = item.request
            start = offsets[request.request_id]
            rows.extend(range(start, start + request.prompt_tokens))
            positions = incoming.positions[start : start + request.prompt_tokens]
            sequences.append(
                PrefillSequence(
                    block_table=item.table,
                    token_ids=request.token_ids,
                    positions=positions if three_d else positions[:, 0].contiguous(),
                    sampling=request.sampling,
                )
            )
        hidden = incoming.hidden if len(rows) == incoming.hidden.shape[0] else incoming.hidden[rows]
        executor = self.work.executor
        num_layers = self.replica.services.host.config.num_layers
        layers = range(incoming.offer.layer, num_layers)
        tokens = len(rows)
        incoming.items = live
        self.running = incoming
        emulated = self.work.emulated_prefill(tokens, len(layers))

        def run() -> PrefillResult:
            return executor.prefill(sequences, layers=layers, hidden=hidden)

        self.work.compute(run, lambda result: self._ran(incoming, result), emulated=emulated)
        return True

    def _ran(self, incoming: IncomingRelay, result: PrefillResult | ModelInputError) -> None:
        self.running = None
        if isinstance(result, ModelInputError):
            self._fail(
                incoming, "internal", f"the relayed batch {incoming.offer.batch_id} was refused: {result}"
            )
            return
        assert result.tokens is not None
        self.work.prefill.complete(incoming.items, result.tokens)
