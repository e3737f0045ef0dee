"""What a replica does in each state (architecture §6), per kind of replica, for the actor's main loop.

A language replica (`LanguageRoles`: configured prefill or decode, with a KV cache) carries the prefill
role and its migration queue, the decode role, and the two ZigZag sides; an encode replica
(`EncodeRoles`) the encode role. Both are built for one run of the replica from its opened endpoints,
and each part gets the small pieces it uses (`replicas.ports`): no part reaches another replica.

`advance()` runs after every inbox batch: it applies the automatic transitions that depend on the
roles' work (shutting drained, flush done, ZigZag episode over — the actor applies the others) and,
when no compute is in flight, starts the next one the state runs (`replicas.states.STATES`, column
`runs`). At most one compute runs per replica (`replicas.step.compute`). `facts()` is what the
replica's snapshot reports of its queues and what it accepts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, final

from messages.commands import Relay, RelayOffer, ReserveKV, SendCachedKV, SendKVHalf, SendWeights
from replicas.actor.loader import Loader
from replicas.actor.pools import EncodeEndpoints, LanguageEndpoints
from replicas.decode.receive import KVLanding
from replicas.decode.work import DecodeWork
from replicas.encode.work import EncodeWork
from replicas.fabric import Fabric
from replicas.faults import FaultHooks
from replicas.inbox import CommandRefused
from replicas.loading.peer_send import send_weights
from replicas.loading.staging import WeightStaging
from replicas.model import KVCache, Model, ModelConfig
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
Move = Callable[[ReplicaState, str], None]


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
    """The roles of one run of a replica, as its actor drives them."""

    def start(self) -> None: ...

    def facts(self) -> RoleFacts: ...

    def submit(self, request: ServingRequest) -> bool: ...

    def entered(self, previous: ReplicaState, target: ReplicaState) -> None: ...

    def advance(self) -> None: ...

    def paired(self, target: ReplicaState, partner: str | None) -> None: ...

    def add_relay_partner(self, old_prefill: str) -> None: ...

    def loading_finished(self) -> None: ...

    def flush(self) -> int: ...

    def offer_relay(self, command: Relay) -> RelayOffer: ...

    def hint(self, new_prefill: str, oldest: float | None) -> None: ...

    def send_half(self, command: SendKVHalf) -> str: ...

    def drop_half(self, request_id: str) -> int: ...

    def reserve(self, command: ReserveKV) -> str: ...

    def withdraw(self, transfer_id: str) -> None: ...

    def send_weights(self, command: SendWeights, model: Model | None, staging: WeightStaging) -> None: ...

    def send_cached(self, command: SendCachedKV) -> int: ...


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
        move: Move,
    ) -> None:
        self._actor = actor
        changed = changes.notify
        self._endpoints = endpoints
        self._settings = settings
        self._compute = compute
        self._loader = loader
        self._move = move
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

    def add_relay_partner(self, old_prefill: str) -> None:
        self.new_prefill.add_partner(old_prefill)

    def loading_finished(self) -> None:
        self.new_prefill.loading_finished()

    # ------------------------------------------------------------------ commands
    def flush(self) -> int:
        """Adopt this replica's own queued migrations (only in MutatingToDecode); returns how many."""
        return self.decode.adopt_local(self.migrator.take_unclaimed())

    def offer_relay(self, command: Relay) -> RelayOffer:
        return self.new_prefill.offer(command)

    def hint(self, new_prefill: str, oldest: float | None) -> None:
        self.old_prefill.hint(new_prefill, oldest)

    def send_half(self, command: SendKVHalf) -> str:
        return self.new_prefill.send_half(command)

    def drop_half(self, request_id: str) -> int:
        return self.new_prefill.drop_half(request_id)

    def reserve(self, command: ReserveKV) -> str:
        return self.decode.reserve(command)

    def withdraw(self, transfer_id: str) -> None:
        return None  # no encode jobs here

    def send_weights(self, command: SendWeights, model: Model | None, staging: WeightStaging) -> None:
        endpoint, transfer = self._endpoints.weights, self._settings.weights_transfer
        send_weights(self._actor, model, staging, endpoint, transfer, command)

    def send_cached(self, command: SendCachedKV) -> int:
        """A pull: send blocks of this replica's prefix cache by key (`replicas.prefill.pull.lend`)."""
        return lend(self._actor, self._kv, self._endpoints.kv, command, self._kv.block_size)

    # ------------------------------------------------------------------ the main loop's step
    def advance(self) -> None:
        """Automatic moves of the roles' states, and the next compute of the current state."""
        state = self._actor.state
        busy = self._compute.busy
        if state is S.OLD_PREFILL:
            self.old_prefill.prune()  # the one place partners leave; the predicates below only read
        if state is S.MUTATING_TO_DECODE:
            self.flush()
            if not busy and self.migrator.idle and not self.prefill.queue and not self._loader.preparing:
                self._move(S.DECODE, "flush adopted the queued migrations")
        elif state is S.REFRACTORY_PREFILL and self.new_prefill.idle and not busy:
            self._move(S.PREFILL, "every ZigZag batch finished or handed over")
        elif state is S.OLD_PREFILL and self.old_prefill.episode_over() and not self._relay_running():
            self._move(S.PREFILL, "no relays left")
        state = self._actor.state
        self.migrator.wake()
        if state in PREFILL_BATCHES or state is S.NEW_PREFILL:
            self.prefill.cancel_sweep()
        if state is S.OLD_PREFILL:
            self.old_prefill.maybe_ask()
        if state in DECODE_STEPS or state in PREFILL_BATCHES:
            self.decode.adopt_arrivals()
        if not self._compute.busy:
            self._start_next(state)
        self._check_drained(self._actor.state)

    def _relay_running(self) -> bool:
        return self._compute.busy and self.old_prefill.running is not None

    def _start_next(self, state: ReplicaState) -> None:
        if state is S.OLD_PREFILL:
            if not self.old_prefill.start_next() and not self.old_prefill.asking:
                self.prefill.start_batch()  # relays first; no own batch while asking (its room was offered)
        elif state in ZIGZAG_NEW:
            self.new_prefill.start_next()
        elif state in PREFILL_BATCHES:
            self.prefill.start_batch()
        elif state in DECODE_STEPS:
            self.decode.start_step()

    def _check_drained(self, state: ReplicaState) -> None:
        if self._compute.busy:
            return
        if state is S.SHUTTING_PREFILL and not self.prefill.queue and self.migrator.idle:
            self._move(S.SHUTTING_NULL, "no unfinished prefills or migrations")
        elif state is S.SHUTTING_DECODE and self.decode.idle:
            self._move(S.SHUTTING_NULL, "no unfinished decodes")


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
        move: Move,
    ) -> None:
        self._actor = actor
        self._endpoints = endpoints
        self._settings = settings
        self._compute = compute
        self._move = move
        self.encode = EncodeWork(
            actor, endpoint=endpoints.emb, transfer=settings.embedding_transfer, compute=compute
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

    def add_relay_partner(self, old_prefill: str) -> None:
        return None

    def loading_finished(self) -> None:
        return None

    def flush(self) -> int:
        return 0  # no prefilled requests here

    def offer_relay(self, command: Relay) -> RelayOffer:
        raise CommandRefused("not_found", f"{self._actor.name} has no batch to hand over now")

    def hint(self, new_prefill: str, oldest: float | None) -> None:
        return None

    def send_half(self, command: SendKVHalf) -> str:
        raise CommandRefused(
            "not_found", f"{self._actor.name} holds no KV half of request {command.request_id}"
        )

    def drop_half(self, request_id: str) -> int:
        return 0

    def reserve(self, command: ReserveKV) -> str:
        raise CommandRefused("overloaded", f"{self._actor.name} is {self._actor.state.value}, not Decode")

    def withdraw(self, transfer_id: str) -> None:
        self.encode.withdraw(transfer_id)

    def send_weights(self, command: SendWeights, model: Model | None, staging: WeightStaging) -> None:
        endpoint, transfer = self._endpoints.weights, self._settings.weights_transfer
        send_weights(self._actor, model, staging, endpoint, transfer, command)

    def send_cached(self, command: SendCachedKV) -> int:
        raise CommandRefused("not_found", f"{self._actor.name} is an encode replica: it caches no KV")

    def advance(self) -> None:
        state = self._actor.state
        if not self._compute.busy and state in ENCODE_JOBS:
            self.encode.start_job()
        if not self._compute.busy and state is S.SHUTTING_ENCODE and self.encode.idle:
            self._move(S.SHUTTING_NULL, "no unfinished encodes")
