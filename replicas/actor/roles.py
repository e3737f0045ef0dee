"""What a replica does in each state (architecture §6), per kind of replica, for the actor's main loop.

A language replica (`LanguageRoles`: configured prefill or decode, with a KV cache) carries the prefill
role and its migration queue, the decode role, and the two ZigZag sides; an encode replica
(`EncodeRoles`) the encode role. Both are built for one run of the replica from its opened endpoints,
and each part gets the small pieces it uses (`replicas.ports`): no part reaches another replica.

Each main-loop pass, after the inbox batch, the actor calls `tend()` (the current state's upkeep),
reads `progress()` — what its automatic moves look at (`replicas.actor.moves`); the roles decide no
move — and calls `start_next()`: when no compute is in flight, the next one the state runs
(`replicas.states.STATES`, column `runs`). At most one compute runs per replica
(`replicas.step.compute`). `commands` is the table of the commands the roles answer
(`replicas.actor.commands`); `facts()` is what the replica's snapshot reports of its queues and what it
accepts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, final

from messages.commands import (
    AddRelayPartner,
    DropKVHalf,
    Flush,
    Relay,
    RelayHint,
    RelayOffer,
    ReserveKV,
    SendCachedKV,
    SendKVHalf,
    WithdrawEncode,
)
from replicas.actor.commands import CommandTable
from replicas.actor.loader import Loader
from replicas.actor.moves import Progress
from replicas.actor.pools import EncodeEndpoints, LanguageEndpoints
from replicas.decode.receive import KVLanding
from replicas.decode.work import DecodeWork
from replicas.encode.work import EncodeWork
from replicas.fabric import Fabric
from replicas.faults import FaultHooks
from replicas.inbox import CommandRefused
from replicas.model import KVCache, ModelConfig
from replicas.ports import Actor, Directory, LiveRequests, NodeSignal
from replicas.prefill.embeddings import EmbeddingReceives
from replicas.prefill.migration import Migrator
from replicas.prefill.pull import Puller, lend
from replicas.prefill.queue import PromptQueue
from replicas.prefill.work import PrefillWork
from replicas.request import ServingRequest
from replicas.settings import ReplicaSettings
from replicas.states import DECODE_STEPS, ENCODE_JOBS, PREFILL_BATCHES, ZIGZAG_NEW, ReplicaState
from replicas.step.compute import Compute
from replicas.zigzag.new_prefill import NewPrefillWork
from replicas.zigzag.old_prefill import OldPrefillWork

S = ReplicaState


@final
@dataclass(frozen=True, slots=True)
class RoleFacts:
    """What a replica's snapshot reports of its roles (see `replicas.snapshot.ReplicaSnapshot`)."""

    work_queue: int = 0
    migration_queue: int = 0
    queued_prompts: int = 0
    queued_prompt_tokens: int = 0
    running_prompt_tokens: int = 0
    decoding: int = 0
    encode_load: int = 0
    embedding_pool: bool = False
    takes_prefill: bool = False
    prefill_limit: int | None = None
    paired_with: tuple[str, ...] = ()


class Roles(Protocol):
    """The roles of one run of a replica, as its actor drives them (see the module docstring)."""

    @property
    def commands(self) -> CommandTable:
        """The commands these roles answer (`replicas.actor.commands`)."""
        ...

    def start(self) -> None: ...

    def facts(self) -> RoleFacts: ...

    def submit(self, request: ServingRequest) -> bool: ...

    def entered(self, previous: ReplicaState, target: ReplicaState) -> None: ...

    def paired(self, target: ReplicaState, partner: str | None) -> None: ...

    def tend(self) -> None: ...

    def progress(self, weights_landed: bool) -> Progress: ...

    def start_next(self) -> None: ...


@final
class LanguageRoles:
    """The roles of a replica with a KV cache (see the module docstring)."""

    def __init__(
        self,
        actor: Actor,
        *,
        endpoints: LanguageEndpoints,
        kv: KVCache,
        config: ModelConfig,
        settings: ReplicaSettings,
        compute: Compute,
        loader: Loader,
        fabric: Fabric,
        faults: FaultHooks,
        requests: LiveRequests,
        directory: Directory,
        returned: Callable[[ServingRequest], None],
        changes: NodeSignal,
    ) -> None:
        self._actor = actor
        changed = changes.notify
        self._endpoints = endpoints
        self._compute = compute
        self._loader = loader
        self._kv = kv
        context, layers = compute.context_length, compute.num_layers
        queue = PromptQueue()
        embeddings = None
        if endpoints.emb is not None and config.image_token_id is not None:
            embeddings = EmbeddingReceives(
                actor,
                endpoint=endpoints.emb,
                fabric=fabric,
                image_token_id=config.image_token_id,
                context_length=context,
                settings=settings,
                faults=faults,
                queue=queue,
                returned=returned,
                changed=changed,
            )
        self.migrator = Migrator(
            actor,
            kv=kv,
            endpoint=endpoints.kv,
            settings=settings,
            directory=directory,
            changes=changes,
            context_length=context,
            num_layers=layers,
        )
        self.prefill = PrefillWork(
            actor,
            queue=queue,
            kv=kv,
            settings=settings,
            compute=compute,
            embeddings=embeddings,
            directory=directory,
            migrate=self.migrator.enqueue,
            returned=returned,
            changed=changed,
            puller=Puller(
                actor,
                kv=kv,
                endpoint=endpoints.kv,
                fabric=fabric,
                directory=directory,
                settings=settings,
                model=lambda: compute.model,
                ended=lambda request: self.prefill.pull_ended(request),
            ),
        )
        landing = KVLanding(actor.name, actor.log, kv, endpoints.kv, fabric, layers)
        self.decode = DecodeWork(
            actor,
            landing=landing,
            settings=settings,
            compute=compute,
            requests=requests,
            faults=faults,
            changed=changed,
        )
        zigzag = {"prefill": self.prefill, "kv": kv, "relay_endpoint": endpoints.relay, "fabric": fabric}
        zigzag |= {"settings": settings, "compute": compute, "directory": directory}
        self.new_prefill = NewPrefillWork(actor, kv_endpoint=endpoints.kv, changed=changed, **zigzag)  # type: ignore[arg-type]
        self.old_prefill = OldPrefillWork(actor, requests=requests, changes=changes, **zigzag)  # type: ignore[arg-type]
        self.commands = (
            CommandTable()
            .on(Flush, lambda _: self.flush())
            .on(Relay, self._offer_relay)
            .on(AddRelayPartner, self._add_relay_partner)
            .on(RelayHint, lambda command: self.old_prefill.hint(command.new_prefill, command.oldest))
            .on(SendKVHalf, self.new_prefill.send_half)
            .on(DropKVHalf, lambda command: self.new_prefill.drop_half(command.request_id))
            .on(ReserveKV, self.decode.reserve)
            .on(SendCachedKV, self._send_cached)
        )

    def start(self) -> None:
        self._actor.spawn(self.migrator.run)

    def facts(self) -> RoleFacts:
        state, queue = self._actor.state, self.prefill.queue
        takes, limit = False, None
        if state is S.PREFILL:
            takes = True
        elif state is S.OLD_PREFILL:
            takes = self.old_prefill.takes_new_work()
        elif state is S.NEW_PREFILL:
            limit = self.new_prefill.prompt_limit()
            takes = limit >= 0
        return RoleFacts(
            work_queue=len(queue) + len(self.new_prefill.batches),
            migration_queue=self.migrator.queued + self.decode.queued,
            queued_prompts=len(queue),
            queued_prompt_tokens=queue.tokens,
            running_prompt_tokens=self.prefill.running_tokens,
            decoding=len(self.decode.running),
            embedding_pool=self._endpoints.emb is not None,
            takes_prefill=takes,
            prefill_limit=limit,
            paired_with=tuple(self._partners(state)),
        )

    def _partners(self, state: ReplicaState) -> list[str]:
        """The replicas this one relays with now (ZigZag); [] outside an episode."""
        if state in ZIGZAG_NEW:
            return self.new_prefill.partners
        if state is S.OLD_PREFILL:
            return self.old_prefill.partners
        return []

    def submit(self, request: ServingRequest) -> bool:
        state = self._actor.state
        takes = state is S.PREFILL or (state is S.OLD_PREFILL and self.old_prefill.takes_new_work())
        if takes or (state is S.NEW_PREFILL and request.prompt_tokens <= self.new_prefill.prompt_limit()):
            self.prefill.enqueue(request)
            return True
        return False

    def entered(self, previous: ReplicaState, target: ReplicaState) -> None:
        if previous is S.NEW_PREFILL and target is S.REFRACTORY_PREFILL:
            # The load finished: requests not yet in a batch go back to the router (before the
            # actor's change signal, whose readiness change dispatches them).
            self.new_prefill.loading_finished()
        if previous in ZIGZAG_NEW and target not in ZIGZAG_NEW:
            self.new_prefill.wake_partners()  # an OldPrefill partner may end its episode
        if target is S.MUTATING_TO_DECODE:
            self.prefill.return_queued("the replica is becoming a decode replica")
        self.migrator.wake()

    def paired(self, target: ReplicaState, partner: str | None) -> None:
        """A commanded NewPrefill / OldPrefill move named (or added) the replica it relays with."""
        if target is S.NEW_PREFILL:
            self.new_prefill.entered(partner)
        elif target is S.OLD_PREFILL:
            self.old_prefill.pair(partner)

    # ------------------------------------------------------------------ commands
    def flush(self) -> int:
        """Adopt this replica's own queued migrations (only in MutatingToDecode); returns how many."""
        return self.decode.adopt_local(self.migrator.take_unclaimed())

    def _offer_relay(self, command: Relay) -> RelayOffer:
        state = self._actor.state
        if state not in ZIGZAG_NEW:
            raise CommandRefused("not_found", f"{self._actor.name} is {state.value}: no batch to relay")
        return self.new_prefill.offer(command)

    def _add_relay_partner(self, command: AddRelayPartner) -> None:
        if self._actor.state in ZIGZAG_NEW:
            self.new_prefill.add_partner(command.old_prefill)

    def _send_cached(self, command: SendCachedKV) -> int:
        """A pull: send blocks of this replica's prefix cache by key (`replicas.prefill.pull.lend`)."""
        return lend(self._actor, self._kv, self._endpoints.kv, command, self._kv.block_size)

    # ------------------------------------------------------------------ the main loop's pass
    def tend(self) -> None:
        """The current state's upkeep, before the automatic moves are looked at: a flush in
        MutatingToDecode, migrations woken, cancelled prompts finished, an OldPrefill's queued prompts
        handed back and a relay asked for, arrived KV adopted."""
        state = self._actor.state
        if state is S.OLD_PREFILL:
            self.old_prefill.prune()  # the one place partners leave; the moves and predicates only read
        if state is S.MUTATING_TO_DECODE:
            self.flush()
        self.migrator.wake()
        if state in PREFILL_BATCHES or state is S.NEW_PREFILL:
            self.prefill.cancel_sweep()
        if state is S.OLD_PREFILL:
            self.old_prefill.hand_back()  # prompts a partner has spare compute for go through it
            self.old_prefill.maybe_ask()
        if state in DECODE_STEPS or state in PREFILL_BATCHES:
            self.decode.adopt_arrivals()

    def progress(self, weights_landed: bool) -> Progress:
        busy = self._compute.busy
        return Progress(
            weights_landed=weights_landed,
            preparing=self._loader.preparing,
            busy=busy,
            prompts_queued=bool(self.prefill.queue),
            migrating=not self.migrator.idle,
            zigzag_batches=not self.new_prefill.idle,
            episode_over=self._actor.state is S.OLD_PREFILL and self.old_prefill.episode_over(),
            relay_running=busy and self.old_prefill.running is not None,
            decoding=not self.decode.idle,
        )

    def start_next(self) -> None:
        """The next compute of the current state, when none is in flight."""
        if self._compute.busy:
            return
        state = self._actor.state
        if state is S.OLD_PREFILL:
            old = self.old_prefill
            if not old.start_next() and not old.asking and not old.leaves_queue():
                # Relays first; no own batch while asking (its room was offered), nor while its prompts
                # may go through a partner's loaded layers (`OldPrefillWork.hand_back`).
                self.prefill.start_batch()
        elif state in ZIGZAG_NEW:
            self.new_prefill.start_next()
        elif state in PREFILL_BATCHES:
            self.prefill.start_batch()
        elif state in DECODE_STEPS:
            self.decode.start_step()


@final
class EncodeRoles:
    """The role of an encode replica (see the module docstring)."""

    def __init__(
        self,
        actor: Actor,
        *,
        endpoints: EncodeEndpoints,
        settings: ReplicaSettings,
        compute: Compute,
    ) -> None:
        self._actor = actor
        self._compute = compute
        self.encode = EncodeWork(
            actor, endpoint=endpoints.emb, transfer=settings.embedding_transfer, compute=compute
        )
        self.commands = CommandTable().on(
            WithdrawEncode, lambda command: self.encode.withdraw(command.transfer_id)
        )

    def start(self) -> None:
        return None

    def facts(self) -> RoleFacts:
        return RoleFacts(work_queue=len(self.encode.queue), encode_load=self.encode.load, embedding_pool=True)

    def submit(self, request: ServingRequest) -> bool:
        if self._actor.state is S.ENCODE:
            self.encode.enqueue(request)
            return True
        return False

    def entered(self, previous: ReplicaState, target: ReplicaState) -> None:
        return None

    def paired(self, target: ReplicaState, partner: str | None) -> None:
        return None

    def tend(self) -> None:
        return None

    def progress(self, weights_landed: bool) -> Progress:
        return Progress(weights_landed=weights_landed, busy=self._compute.busy, encoding=not self.encode.idle)

    def start_next(self) -> None:
        if not self._compute.busy and self._actor.state in ENCODE_JOBS:
            self.encode.start_job()
