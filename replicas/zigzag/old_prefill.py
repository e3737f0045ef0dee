"""The OldPrefill side of ZigZag (architecture §8): finish the batches a NewPrefill partner began.

An `OldPrefill` replica keeps serving its own queue — the prompts no partner has spare compute for; the
others it hands back to the router, which gives them to a partner (`hand_back`) — and, whenever it holds
no relay, asks its partners in turn for work (`Relay`, with the KV room it has). On an offer it reserves
blocks for the batch's prompts in its own KV pool, receives the hidden states (`wire.receive`) and —
before any batch of its own — runs layers `[n, L)`, the final norm and the head, and samples each first
token; the requests then migrate as usual, except that their KV travels in two halves (layers `[n, L)`
from here, `[0, n)` from the partner) into one reservation on one decode replica
(`replicas.prefill.migration`). A partner that computed a batch hints (`hint`) so the next ask is not a
blind one. The replica returns to `Prefill` by itself when no partner is still `NewPrefill` or
`RefractoryPrefill` and no relay is in hand.

Cancellation: a relay being received is cancelled with the replica; its requests are held by this
replica (`holder`), so a failure of the replica fails them, and their halves on the partner are freed
by the requests' end hooks.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, final

import trio

from messages.commands import AddRelayPartner, Relay, RelayOffer
from messages.control import ErrorCode
from messages.control_replies import RelayInfo, TransferSummary
from messages.log.events import RelayReceived
from replicas.fabric import Fabric, UnknownEndpoint
from replicas.inbox import CommandRefused, new_command_id
from replicas.model import KVCache, ModelInputError, PrefillResult, PrefillSequence, token_history
from replicas.ports import Actor, Directory, LiveRequests, NodeSignal, peer_named, tell_peer
from replicas.prefill.work import PrefillWork
from replicas.request import ServingRequest
from replicas.settings import ReplicaSettings
from replicas.states import ZIGZAG_NEW, ReplicaState
from replicas.step.apply import refuse
from replicas.step.compute import Compute
from replicas.step.grammar import grammar_rows
from replicas.step.plan import Held, PrefillCall
from replicas.zigzag import wire
from transport.endpoint import TransferEndpoint
from transport.errors import HandshakeRefused, LinkError, TransferError

if TYPE_CHECKING:
    import torch

S = ReplicaState
# How long a partner on another node may go unreported as NewPrefill after the pairing: a few of its
# node's report heartbeats (one a second).
REPORT_GRACE = 5.0


@final
@dataclass(slots=True)
class IncomingRelay:
    offer: RelayOffer
    items: list[Held]
    hidden: torch.Tensor | None = None
    positions: torch.Tensor | None = None


@final
class OldPrefillWork:
    """See the module docstring. Relayed batches land at `relay_endpoint`, their KV in `kv`; they finish
    through the replica's `prefill` role, whose queue it weighs against its partners' batches."""

    def __init__(
        self,
        actor: Actor,
        *,
        prefill: PrefillWork,
        kv: KVCache,
        relay_endpoint: TransferEndpoint,
        fabric: Fabric,
        settings: ReplicaSettings,
        compute: Compute,
        directory: Directory,
        requests: LiveRequests,
        changes: NodeSignal,
    ) -> None:
        self._actor = actor
        self._prefill = prefill
        self._kv = kv
        self._relay_endpoint = relay_endpoint
        self._fabric = fabric
        self._settings = settings
        self._compute = compute
        self._directory = directory
        self._requests = requests
        self._changes = changes
        self._no_remote: trio.Event | None = None  # set once no partner lives on another node
        self._reported_by: dict[str, float] = {}  # partner on another node → when its report is due
        self.partners: list[str] = []
        self.asking = False
        self.hinted = True
        self.receiving: IncomingRelay | None = None
        self.ready: deque[IncomingRelay] = deque()
        self.running: RelayPlan | None = None
        self.waiting: dict[str, float] = {}  # partner → arrival of the oldest request it would hand over

    @property
    def in_hand(self) -> bool:
        """A relay is being asked for, received, waiting to run or running."""
        return self.asking or self.receiving is not None or bool(self.ready) or self.running is not None

    def pair(self, partner: str | None) -> None:
        """Relay with `partner` too (a NewPrefill replica, of this node or another), which hears of it
        (`AddRelayPartner`). A partner on another node changes state in its node's reports: while one is
        paired, every node-wide change (a report taken is one) wakes this replica to look again."""
        if partner is not None and partner not in self.partners:
            self.partners.append(partner)
        if partner is not None:
            command = AddRelayPartner(command_id=new_command_id(), old_prefill=self._actor.name)
            tell_peer(self._actor, self._directory, partner, command)
            if self._directory.get(partner) is None:
                self._reported_by[partner] = trio.current_time() + REPORT_GRACE
                if self._no_remote is None:
                    self._no_remote = trio.Event()
                    self._actor.spawn(self._follow_reports, self._no_remote)
        self.hinted = True

    def hint(self, partner: str, oldest: float | None) -> None:
        """Partner `partner` holds a batch ready to hand over whose oldest request arrived at `oldest`
        (wall clock; None: it holds none now)."""
        if oldest is None:
            self.waiting.pop(partner, None)
        else:
            self.waiting[partner] = oldest
            self.hinted = True
        self._actor.post()

    def takes_new_work(self) -> bool:
        """Whether the router may queue new requests here: always with `old_prefill_serves_queue` (the
        router sends none of at most a batch while a partner has spare compute, `engine.router`);
        otherwise once no partner takes new work any more (the episode is ending)."""
        if self._settings.old_prefill_serves_queue:
            return True
        return not any(self._state_of(p) is S.NEW_PREFILL for p in self.partners)

    def hand_back(self) -> int:
        """Give this replica's queued prompts that have not started back to the router, oldest first,
        while a partner in the episode has spare compute for them (its snapshot's `prefill_limit`, the
        room `replicas.zigzag.limits` gives it, less what went before): the router then hands them to
        that partner, and they come back as relays at the layer it reached instead of running here whole
        (main loop, each pass; docs/zigzag.md). Returns how many went."""
        rooms = [0]
        for name in self.live_partners():
            partner = peer_named(self._directory, name)
            snap = None if partner is None else partner.snapshot()
            if snap is not None and snap.spare_compute(images=False) and snap.prefill_limit is not None:
                rooms.append(snap.prefill_limit)
        left = max(rooms)
        if not left or not self._prefill.queue:
            return 0

        def room(request: ServingRequest) -> bool:
            nonlocal left
            if request.prompt_tokens > left:
                return False
            left -= request.prompt_tokens
            return True

        return self._prefill.hand_back(room)

    def leaves_queue(self) -> bool:
        """Whether to start no batch of its own now: its oldest ready prompt (of at most a batch, no
        images) is one a partner in the episode has spare compute for — `hand_back` gives it to that
        partner once its room fits it — so this replica computes only the layers its partner lacks."""
        own = self._prefill.queue.first_ready()
        if own is None or own.has_images or own.prompt_tokens > self._settings.max_batch_tokens:
            return False
        for name in self.live_partners():
            partner = peer_named(self._directory, name)
            if partner is not None and partner.snapshot().spare_compute(images=False):
                return True
        return False

    def _state_of(self, name: str) -> ReplicaState | None:
        partner = peer_named(self._directory, name)
        return None if partner is None else partner.state

    def relay_first(self) -> bool:
        """First come, first served across the two queues: ask for a relay unless this replica's own
        queue holds a ready request that arrived before every batch its partners hold (a partner that
        always has a batch ready would otherwise starve the own queue for the whole episode) and that
        it does not leave to a partner (`leaves_queue`)."""
        own = self._prefill.queue.first_ready()
        if own is None or not self.waiting or self.leaves_queue():
            return True
        return min(self.waiting.values()) <= own.stamps.arrived

    def live_partners(self) -> list[str]:
        """The partners still in the episode (pure: `prune` forgets the others). One on another node is
        known from its node's reports, which lag: paired as it moved to NewPrefill, it may still be
        reported `LoadingPrefill`, or not listed yet; it counts as in the episode until a report says
        NewPrefill, for up to `REPORT_GRACE` seconds after the pairing (its node may have died
        meanwhile)."""
        now = trio.current_time()
        return [p for p in self.partners if self._in_episode(p, now)]

    def prune(self) -> None:
        """The one place partners leave (main loop, once a pass, before the predicates read them): those
        no longer in the episode are forgotten, and so is the grace of one its node now reports in it;
        once no partner lives on another node, the report watch ends."""
        self.partners = self.live_partners()
        for name in list(self._reported_by):
            if name not in self.partners or self._state_of(name) in ZIGZAG_NEW:
                del self._reported_by[name]
        if self._no_remote is not None and all(self._directory.get(p) is not None for p in self.partners):
            self._no_remote.set()
            self._no_remote = None

    async def _follow_reports(self, no_remote: trio.Event) -> None:
        """Wake this replica at every node-wide change (a report taken is one) until `no_remote` is set
        or the replica stops (see `pair`)."""
        unwatch = self._changes.watch(self._actor.post)
        try:
            await no_remote.wait()
        finally:
            unwatch()

    def _in_episode(self, name: str, now: float) -> bool:
        """Pure: `name` is reported in the episode, or not yet reported and within its grace."""
        state = self._state_of(name)
        if state in ZIGZAG_NEW:
            return True
        by = self._reported_by.get(name)  # not yet reported NewPrefill: still `LoadingPrefill`, or unlisted
        return by is not None and state in (None, S.LOADING_PREFILL) and now < by

    def episode_over(self) -> bool:
        return not self.live_partners() and not self.in_hand

    # ------------------------------------------------------------------ asking
    def maybe_ask(self) -> None:
        if self._compute.busy:
            return  # ask when free: the partner's batch has gone as far as it can by then
        partners = self.live_partners()
        if self.in_hand or not self.hinted or not partners or not self.relay_first():
            return
        kv = self._kv
        self.asking, self.hinted = True, False
        self._actor.spawn(self._ask, partners, kv.pool.available_blocks * kv.block_size)

    async def _ask(self, partners: list[str], room_tokens: int) -> None:
        timeout = self._settings.kv_transfer.handshake_timeout
        for name in partners:
            partner = peer_named(self._directory, name)
            if partner is None:
                continue
            command = Relay(
                command_id=new_command_id(), old_prefill=self._actor.name, room_tokens=room_tokens
            )
            try:
                offer = await partner.ask(command, timeout=timeout)
            except CommandRefused:
                continue
            self._actor.later(functools.partial(self._accept, offer))
            return
        self._actor.later(self._nothing)

    def _nothing(self) -> None:
        self.asking = False

    def _accept(self, offer: RelayOffer) -> None:
        self.asking = False
        kv = self._kv
        info = RelayInfo(new_prefill=offer.new_prefill, old_prefill=self._actor.name, layer=offer.layer)
        items: list[Held] = []
        for relayed in offer.requests:
            request = self._requests.get(relayed.request_id)
            if request is None:
                continue  # ended meanwhile: its half on the partner went with it
            table = kv.pool.try_allocate(kv.blocks_for(relayed.prompt_tokens), relayed.request_id)
            if table is None:  # the room was announced in the ask; only a bug gets here
                request.fail(
                    "overloaded", f"{self._actor.name}: no KV room for relayed request {relayed.request_id}"
                )
                continue
            items.append(Held(request, table, relay=info))
        incoming = IncomingRelay(offer, items)
        self.receiving = incoming
        self._actor.spawn(self._receive, incoming)

    async def _receive(self, incoming: IncomingRelay) -> None:
        error: BaseException | None = None
        received: wire.Received | None = None
        try:
            received = await wire.receive(self._relay_endpoint, self._fabric, incoming.offer)
        except (TransferError, LinkError, HandshakeRefused, UnknownEndpoint) as exc:
            error = exc
        self._actor.later(lambda: self._received(incoming, received, error))

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
        self._fabric.count_bytes(offer.new_prefill, self._actor.name, "relay", report.bytes)
        for item in incoming.items:
            item.request.transfers.append(
                TransferSummary(
                    kind="relay",
                    transfer_id=offer.transfer_id,
                    source=offer.new_prefill,
                    destination=self._actor.name,
                    rounds=report.rounds,
                    bytes=report.bytes,
                    seconds=report.seconds,
                    transport=self._fabric.kind,
                )
            )
        self._actor.log.emit(
            RelayReceived(
                batch_id=offer.batch_id,
                new_prefill=offer.new_prefill,
                old_prefill=self._actor.name,
                layer=offer.layer,
                bytes=received.report.bytes,
                seconds=received.report.seconds,
            )
        )
        self.ready.append(incoming)

    def _fail(self, incoming: IncomingRelay, code: ErrorCode, message: str) -> None:
        refuse(incoming.items, code=code, message=message, release=self._prefill.release, cancel_wins=True)

    # ------------------------------------------------------------------ compute
    def start_next(self) -> bool:
        """Plan, execute and apply the oldest received relay (main loop, not busy): `plan_relay` decides,
        this releases what it drops and runs what it keeps; `_ran` applies the result. False when none
        runs."""
        executor = self._compute.executor
        if not self.ready or executor is None:
            return False
        incoming = self.ready.popleft()
        assert incoming.hidden is not None and incoming.positions is not None  # received
        plan = plan_relay(incoming, rows=incoming.hidden.shape[0], num_layers=self._compute.num_layers)
        for item in plan.dropped:
            self._prefill.release(item)
            if not item.request.ended:
                item.request.finish("cancelled")
        if not plan.items:
            return False
        three_d = self._compute.config.position_axes == 3
        sequences: list[PrefillSequence] = []
        for item, start in zip(plan.items, plan.starts, strict=True):
            request = item.request
            positions = incoming.positions[start : start + request.prompt_tokens]
            sequences.append(
                PrefillSequence(
                    block_table=item.table,
                    token_ids=request.token_ids,
                    positions=positions if three_d else positions[:, 0].contiguous(),
                    sampling=request.sampling,
                    logprobs=request.logprobs,
                    prompt_logprobs=request.prompt_logprobs,
                    history=token_history(request.sampling, request.token_ids, request.generated),
                )
            )
        hidden = incoming.hidden if plan.rows is None else incoming.hidden[list(plan.rows)]
        self.running = plan
        call = PrefillCall(
            sequences,
            layers=plan.layers,
            hidden=hidden,
            grammars=grammar_rows([i.request for i in plan.items]),
        )
        self._compute.run(
            lambda: call.run(executor),
            functools.partial(self._ran, plan),
            functools.partial(self._refused, plan),
            emulated=self._compute.emulated_prefill(plan.tokens, len(plan.layers)),
        )
        return True

    def _ran(self, plan: RelayPlan, result: PrefillResult) -> None:
        self.running = None
        assert result.tokens is not None  # the layers ran to the end, and the head
        self._prefill.complete(list(plan.items), result)

    def _refused(self, plan: RelayPlan, error: ModelInputError) -> None:
        self.running = None
        message = f"the relayed batch {plan.batch_id} was refused: {error}"
        refuse(
            list(plan.items),
            code="internal",
            message=message,
            release=self._prefill.release,
            cancel_wins=True,
        )


@final
@dataclass(frozen=True, slots=True)
class RelayPlan:
    """What a received relay runs: `items`, its requests still live, in the offer's order, each from
    row `starts[i]` of the relayed hidden states; `dropped`, those that ended or were cancelled while it
    landed (released, the cancelled finished); `rows`: the hidden-state rows `items` take (None: all);
    `layers`: the layers left to run, then the head."""

    batch_id: str
    items: tuple[Held, ...]
    dropped: tuple[Held, ...]
    starts: tuple[int, ...]
    rows: tuple[int, ...] | None
    layers: range

    @property
    def tokens(self) -> int:
        return sum(item.request.prompt_tokens for item in self.items)


def plan_relay(incoming: IncomingRelay, *, rows: int, num_layers: int) -> RelayPlan:
    """The plan of `incoming` (`rows` hidden-state rows landed, a model of `num_layers`); pure."""
    offsets = {r.request_id: r.offset for r in incoming.offer.requests}
    items = tuple(i for i in incoming.items if not (i.request.ended or i.request.cancelled))
    dropped = tuple(i for i in incoming.items if i.request.ended or i.request.cancelled)
    starts = tuple(offsets[item.request.request_id] for item in items)
    kept = [
        r for item, s in zip(items, starts, strict=True) for r in range(s, s + item.request.prompt_tokens)
    ]
    return RelayPlan(
        batch_id=incoming.offer.batch_id,
        items=items,
        dropped=dropped,
        starts=starts,
        rows=None if len(kept) == rows else tuple(kept),
        layers=range(incoming.offer.layer, num_layers),
    )
