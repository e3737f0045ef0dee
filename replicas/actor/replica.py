"""The replica actor (architecture §6): one Trio task that owns all of a replica's state.

A replica is closed. Others read its `snapshot()` (a frozen `ReplicaSnapshot`: state, lock, queues,
blocks, weights, executor) and send it commands — `ask` / `tell` a `ReplicaCommand`, `submit` a request
to its work queue, `post` a wake-up; nothing outside it touches its queues, pools or role objects.

Everything that reaches a replica goes through its *inbox*: commands (`messages.commands`), the
transfer protocol's sender-bound messages, and the completions of its own helpers. The main loop drains
the inbox — commands first — then lets the current state's behaviour (`replicas.actor.roles`) make its
automatic moves and start at most one compute (a prefill batch, a decode step, an encode job) in a
worker thread, and sleeps until the next item. It never blocks on compute, so control is never stuck
behind work; and it is the only writer of the state: helpers (the migrator, transfers, loading) post
their outcomes to the inbox.

Each run of the task gets fresh role objects, built from its opened endpoints; what a part of an earlier
run (before a failure and restart) still posts or spawns is dropped.

Cancellation: cancelling `run` cancels the replica's nursery — transfers abort (their blocks return to
the pools through the transport's shielded cleanup), a compute in a worker thread finishes (threads are
never abandoned) and its result is dropped. Any other exception ends `run`; the supervisor then fails
the replica's requests and frees its blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any, Literal, assert_never, final

import trio

from messages.cluster import MAX_PREFIX_KEYS, PrefixDelta
from messages.commands import (
    AddRelayPartner,
    DropKVHalf,
    Flush,
    Lock,
    Relay,
    RelayHint,
    ReplicaCommand,
    ReserveKV,
    SendCachedKV,
    SendKVHalf,
    SendWeights,
    Transition,
    Unlock,
    WithdrawEncode,
)
from messages.control import LockReason
from messages.log.events import ReplicaLocked, ReplicaStateChanged, ReplicaUnlocked
from messages.transfer import Abort, Grant, RequestMoreCache, StatusUpdate
from replicas.actor.loader import Loader
from replicas.actor.pools import EncodeEndpoints, EncodePools, LanguageEndpoints, LanguagePools
from replicas.actor.roles import EncodeRoles, LanguageRoles, Roles
from replicas.fabric import Fabric
from replicas.faults import NO_FAULTS, FaultHooks
from replicas.inbox import CommandRefused, Completed, Envelope, InboxItem
from replicas.loading.copy import CopyTarget
from replicas.loading.progress import WeightsStatus
from replicas.model import Model
from replicas.ports import Directory, EventSink, LiveRequests, NodeSignal
from replicas.request import ServingRequest
from replicas.settings import ReplicaSettings
from replicas.snapshot import ReplicaSnapshot
from replicas.states import (
    LOADING_STATE,
    SERVING_ROLE,
    STATE_ROLE,
    STATES,
    ZIGZAG_NEW,
    InvalidTransition,
    ReplicaState,
    Role,
    check_automatic,
    check_command,
    parse_state,
)
from replicas.step.compute import Compute
from replicas.weights import ModelHost
from transport.endpoint import SenderDelivery

S = ReplicaState


@final
class _Mailbox:
    """What the parts of one run of a replica post and spawn through (`replicas.ports.Actor`); once the
    run is over (`close`) it drops everything, so a stale part cannot reach the next run."""

    def __init__(self, replica: Replica) -> None:
        self._replica = replica
        self.nursery: trio.Nursery | None = None
        self.closed = False

    @property
    def name(self) -> str:
        return self._replica.name

    @property
    def log(self) -> EventSink:
        return self._replica.log

    @property
    def state(self) -> ReplicaState:
        return self._replica.state

    def post(self, item: InboxItem = None) -> None:
        if not self.closed:
            self._replica.post(item)

    def later(self, apply: Callable[[], None]) -> None:
        self.post(Completed(lambda _: apply()))

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        if self.closed:
            return
        assert self.nursery is not None, f"{self.name}: a helper started outside a run"
        self.nursery.start_soon(fn, *args)

    def close(self) -> None:
        self.closed = True
        self.nursery = None


@final
class Replica:
    """See the module docstring. `name` is `{role}-{index}`; `role` is the role it was configured for
    (its pools). The node gives it its settings, the model host, the fabric, the log, its live requests,
    the replicas it may address, its fault hooks, an event — `returned`: a request it will not start
    goes back to the router — and the node-wide change signal (`changes`: it notifies it when its
    state, lock, room or held blocks changed, and its migration queue watches it)."""

    def __init__(
        self,
        name: str,
        role: Role,
        *,
        settings: ReplicaSettings,
        host: ModelHost,
        fabric: Fabric,
        log: EventSink,
        requests: LiveRequests,
        directory: Directory,
        returned: Callable[[ServingRequest], None],
        changes: NodeSignal,
        faults: FaultHooks = NO_FAULTS,
    ) -> None:
        self.name = name
        self.role = role
        self._settings = settings
        self._host = host
        self._fabric = fabric
        self.log = log.bind(replica=name)
        self._requests = requests
        self._directory = directory
        self._returned = returned
        self._changes = changes
        self._changed = changes.notify
        self._faults = faults
        self._state = S.INACTIVE
        self.state_since = trio.current_time()  # when it entered `state` (Trio's clock)
        self._lock_reasons: set[LockReason] = set()
        self.last_error: str | None = None
        config, device = host.config, host.device
        self._pools: LanguagePools | EncodePools
        if role == "encode":
            self._pools = EncodePools(name, config, settings, device)
        else:
            landing = config.image_token_id is not None and role == "prefill"
            self._pools = LanguagePools(name, config, settings, device, landing=landing)
        self._inbox_send, self._inbox = trio.open_memory_channel[InboxItem](math.inf)
        self._sender_send, self._sender_receive = trio.open_memory_channel[SenderDelivery](math.inf)
        self._unhandled: list[Envelope] = []
        self._new_life()

    def _new_life(self) -> None:
        """Fresh per-run parts: the mailbox, the compute slot, the weights status (roles come with `run`)."""
        self._mailbox = _Mailbox(self)
        self._compute = Compute(self._mailbox, self._host.config, self._settings.emulated)
        self._weights = WeightsStatus(self._host.config.num_layers)
        self._roles: Roles | None = None
        self._loader: Loader | None = None
        self._weights_endpoint_open = False

    # ------------------------------------------------------------------ what others may read
    @property
    def state(self) -> ReplicaState:
        return self._state

    @property
    def lock_reasons(self) -> frozenset[str]:
        return frozenset(self._lock_reasons)

    @property
    def locked(self) -> bool:
        """Non-decode replicas are always locked; a decode replica while any lock reason holds."""
        return self._state is not S.DECODE or bool(self._lock_reasons)

    @property
    def model(self) -> Model | None:
        """The weights it serves now (None: none loaded)."""
        return self._compute.model

    def snapshot(self) -> ReplicaSnapshot:
        """Its state and load now (see `replicas.snapshot`)."""
        pools, roles, executor = self._pools, self._roles, self._compute.executor
        used_kv, total_kv = pools.kv_usage()
        facts = None if roles is None else roles.facts()
        model = self._compute.model
        return ReplicaSnapshot(
            name=self.name,
            role=self.role,
            state=self._state,
            serving_role=SERVING_ROLE.get(self._state) or self.role,
            locked=self.locked,
            lock_reasons=tuple(sorted(self._lock_reasons)),
            last_error=self.last_error,
            running=self._mailbox.nursery is not None,
            work_queue=0 if facts is None else facts.work_queue,
            migration_queue=0 if facts is None else facts.migration_queue,
            queued_prompts=0 if facts is None else facts.queued_prompts,
            queued_prompt_tokens=0 if facts is None else facts.queued_prompt_tokens,
            running_prompt_tokens=0 if facts is None else facts.running_prompt_tokens,
            decoding=0 if facts is None else facts.decoding,
            encode_load=0 if facts is None else facts.encode_load,
            embedding_pool=facts is not None and facts.embedding_pool,
            takes_prefill=facts is not None and facts.takes_prefill,
            prefill_limit=None if facts is None else facts.prefill_limit,
            used_blocks=pools.used_blocks(),
            cached_blocks=used_kv,
            kv_blocks=total_kv,
            total_blocks=pools.total_blocks(),
            loaded_layers=self._weights.loaded_layers,
            total_layers=self._weights.total_layers,
            weights_source=self._weights.source,
            weights_bytes_loaded=self._weights.bytes_loaded,
            serves_weights=self._weights_endpoint_open and model is not None and model.fully_loaded,
            paired_with=() if facts is None else facts.paired_with,
            executor=None if executor is None else executor.path,
            executor_fallbacks=() if executor is None else tuple(executor.fallbacks),
            prefix_blocks=pools.prefix_blocks(),
            prefix_evicted=pools.prefix_evicted(),
        )

    def leaks(self) -> dict[str, dict[str, int]]:
        """Pool name → owner → blocks still allocated (checked at shutdown)."""
        return self._pools.leaks()

    # ------------------------------------------------------------------ what others may send
    def post(self, item: InboxItem = None) -> None:
        """Put `item` in the inbox (None: wake the loop to look at its queues again)."""
        self._inbox_send.send_nowait(item)

    async def ask(self, command: ReplicaCommand, *, timeout: float = 30.0) -> Any:
        """Send `command` and wait for its outcome; raises `CommandRefused` — also, with `replica_failed`,
        when no outcome comes within `timeout` seconds (the loop never blocks, so one that does not
        answer is stuck or gone)."""
        envelope = Envelope(command)
        self.post(envelope)
        with trio.move_on_after(timeout):
            await envelope.done.wait()
        if not envelope.done.is_set():
            raise CommandRefused(
                "replica_failed",
                f"{self.name} did not answer the {type(command).__name__} command within {timeout:g} s "
                f"(state {self._state.value}; last error: {self.last_error})",
            )
        if envelope.error is not None:
            raise envelope.error
        return envelope.result

    def tell(self, command: ReplicaCommand) -> None:
        """Send `command` without waiting for its outcome."""
        self.post(Envelope(command))

    def prefix_match(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` its prefix cache holds (0 without a KV cache)."""
        pools = self._pools
        return pools.kv.prefix.match(keys) if isinstance(pools, LanguagePools) else 0

    def prefix_delta(self, since: int | None) -> PrefixDelta | None:
        """What its prefix cache holds, as a change from version `since` (a whole view when `since`
        is None or too old; `MAX_PREFIX_KEYS` keys at most); None without a KV cache."""
        pools = self._pools
        if not isinstance(pools, LanguagePools):
            return None
        cache = pools.kv.prefix
        changes = None if since is None else cache.changes_since(since, limit=MAX_PREFIX_KEYS)
        if changes is None:
            return PrefixDelta(version=cache.version, base=None, added=cache.recent_keys(MAX_PREFIX_KEYS))
        added, removed = changes
        return PrefixDelta(version=cache.version, base=since, added=added, removed=removed)

    def submit(self, request: ServingRequest) -> bool:
        """Queue `request` for this replica's role; False when it takes no new work now — also while its
        task is not running: between a failure and the supervisor marking it `Inactive` its state still
        says it serves, and the router's request then failed with an internal error."""
        roles = self._roles
        if self._mailbox.nursery is None or roles is None:
            return False
        accepted = roles.submit(request)
        if accepted:
            self.post()
        return accepted

    # ------------------------------------------------------------------ the task
    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled (see the module docstring)."""
        async with AsyncExitStack() as stack:
            pools, settings = self._pools, self._settings
            plan = self._faults.transfer_plan(self.name)
            endpoints = await pools.open(stack, self._fabric, settings, plan, self._sender_send)
            mailbox = self._mailbox
            mailbox.nursery = nursery = await stack.enter_async_context(trio.open_nursery())
            self._weights_endpoint_open = True
            target = CopyTarget(
                name=self.name,
                log=self.log,
                endpoint=endpoints.weights,
                host=self._host,
                fabric=self._fabric,
                faults=self._faults,
                directory=self._directory,
                timeout=settings.weights_transfer.progress_timeout,
                changes=self._changes,
            )
            kv = pools.kv if isinstance(pools, LanguagePools) else None
            self._loader = loader = Loader(
                mailbox,
                compute=self._compute,
                weights=self._weights,
                host=self._host,
                settings=settings,
                kv=kv,
                target=target,
                loaded=self._loaded,
                changed=self._changed,
            )
            self._roles = self._build_roles(endpoints, loader)
            nursery.start_soon(self._forward_sender_messages)
            self._roles.start()
            task_status.started()
            stopped = False
            try:
                await self._main_loop()
            except trio.Cancelled:
                stopped = True
                raise
            finally:
                self._weights_endpoint_open = False
                mailbox.nursery = None
                nursery.cancel_scope.cancel()
                if stopped:  # in the same step: nothing posted while it ran waits on a closed inbox
                    self._refuse_unhandled("stopped")

    def _build_roles(self, endpoints: LanguageEndpoints | EncodeEndpoints, loader: Loader) -> Roles:
        pools, mailbox = self._pools, self._mailbox
        if isinstance(pools, EncodePools):
            assert isinstance(endpoints, EncodeEndpoints)
            return EncodeRoles(
                mailbox, endpoints=endpoints, settings=self._settings, compute=self._compute, move=self.move
            )
        assert isinstance(endpoints, LanguageEndpoints)
        return LanguageRoles(
            mailbox,
            endpoints=endpoints,
            kv=pools.kv,
            config=self._host.config,
            settings=self._settings,
            compute=self._compute,
            loader=loader,
            fabric=self._fabric,
            faults=self._faults,
            requests=self._requests,
            directory=self._directory,
            returned=self._returned,
            changes=self._changes,
            move=self.move,
        )

    async def _main_loop(self) -> None:
        while True:
            item = await self._inbox.receive()
            items = [item]
            while True:
                try:
                    items.append(self._inbox.receive_nowait())
                except trio.WouldBlock:
                    break
            # Commands first, then completions: control is never stuck behind work.
            envelopes = [i for i in items if isinstance(i, Envelope)]
            for index, envelope in enumerate(envelopes):
                try:
                    self._handle(envelope)
                except BaseException:
                    self._unhandled.extend(envelopes[index + 1 :])  # refused by `reset`
                    raise
            for completed in (i for i in items if isinstance(i, Completed)):
                if completed.error is not None:
                    raise completed.error
                completed.apply(completed.result)
            self._faults.loop_step(self.name, self.log)
            self._advance()

    async def _forward_sender_messages(self) -> None:
        async for delivery in self._sender_receive:
            self.post(Envelope(delivery.message, link=delivery.link))

    def _advance(self) -> None:
        """Automatic moves, and the next compute of the current state (after every inbox batch)."""
        roles, loader = self._roles, self._loader
        assert roles is not None and loader is not None
        row = STATES[self._state]
        if row.phase == "reviving" and row.settles_to is not None and not loader.preparing:
            self.move(row.settles_to, "revived")
        roles.advance()

    # ------------------------------------------------------------------ commands
    def _handle(self, envelope: Envelope) -> None:
        """Run one command. A refusal is its outcome; any other error is the replica's failure, and the
        command's outcome says so (`replica_failed`) instead of a result it never produced."""
        try:
            envelope.result = self._dispatch(envelope)
        except CommandRefused as exc:
            envelope.error = exc
        except Exception as exc:
            envelope.error = CommandRefused(
                "replica_failed",
                f"{self.name} failed handling the {type(envelope.command).__name__} command: "
                f"{type(exc).__name__}: {exc}",
            )
            raise
        finally:
            envelope.done.set()

    def _dispatch(self, envelope: Envelope) -> Any:
        command = envelope.command
        roles = self._roles
        assert roles is not None
        match command:
            case Transition(to=to):
                target = parse_state(to)
                if target is S.OLD_PREFILL and self._state is S.OLD_PREFILL and command.paired_with:
                    roles.paired(target, command.paired_with)  # one more partner (shared)
                    return self._state
                self._check_command(target)  # refused: nothing about the replica changes
                self._weights.commanded(to, command.source, command.chain_from)  # what Loading* loads from
                previous = self._state
                self._enter(target, "command", f"{command.origin} command")
                roles.paired(target, command.paired_with)
                return previous
            case Lock(reason=reason):
                return self._lock(reason)
            case Unlock(reason=reason):
                return self._unlock(reason)
            case Flush():
                return roles.flush()
            case Relay():
                if self._state not in ZIGZAG_NEW:
                    raise CommandRefused(
                        "not_found", f"{self.name} is {self._state.value}: no batch to relay"
                    )
                return roles.offer_relay(command)
            case AddRelayPartner():
                if self._state in ZIGZAG_NEW:
                    roles.add_relay_partner(command.old_prefill)
                return None
            case RelayHint():
                roles.hint(command.new_prefill, command.oldest)
                return None
            case SendKVHalf():
                return roles.send_half(command)
            case DropKVHalf():
                return roles.drop_half(command.request_id)
            case ReserveKV():
                if self._state is not S.DECODE:
                    raise CommandRefused("overloaded", f"{self.name} is {self._state.value}, not Decode")
                if self._lock_reasons:
                    raise CommandRefused(
                        "overloaded", f"{self.name} is locked ({', '.join(sorted(self._lock_reasons))})"
                    )
                return roles.reserve(command)
            case SendWeights():
                return roles.send_weights(command, self._compute.model, self._pools.weights)
            case WithdrawEncode():
                roles.withdraw(command.transfer_id)
                return None
            case SendCachedKV():
                return roles.send_cached(command)
            case Grant() | RequestMoreCache() | Abort() | StatusUpdate():
                assert envelope.link is not None
                self._pools.deliver(SenderDelivery(envelope.link, command))
                return None
            case _:
                assert_never(command)

    def _check_command(self, target: ReplicaState) -> None:
        """Raises `CommandRefused` when a commanded move to `target` may not happen now."""
        previous = self._state
        try:
            check_command(self.name, previous, target)
        except InvalidTransition as exc:
            raise CommandRefused("invalid_transition", str(exc)) from None
        missing = self._missing_pool(target)
        if missing is not None:
            raise CommandRefused(
                "invalid_transition",
                f"{self.name}: cannot move from {previous.value} to {target.value}: {missing} "
                f"(it was configured as {'an' if self.role == 'encode' else 'a'} {self.role} replica)",
            )

    def _missing_pool(self, target: ReplicaState) -> str | None:
        """Why this replica's pools cannot serve the role `target` leads to (None: they can).

        A role change keeps the pools the replica was built with: prefill needs a KV cache and, for a
        model with a vision encoder, an embedding landing pool; decode a KV cache; encode an encoder's
        embedding pool. (Image requests would otherwise wait for a prefill replica that can take them.)"""
        role = STATE_ROLE.get(target)
        pools = self._pools
        if role == "encode" and self.role != "encode":
            return "it has no encoder output pool to serve encode"
        if role in ("prefill", "decode") and not isinstance(pools, LanguagePools):
            return f"it has no KV cache to serve {role}"
        vision = self._host.config.image_token_id is not None
        if role == "prefill" and vision and (not isinstance(pools, LanguagePools) or pools.emb is None):
            return "it has no embedding landing pool for the model's images, so it cannot serve prefill"
        return None

    def move(self, target: ReplicaState, reason: str) -> None:
        """An automatic move (the role behaviour calls it from the main loop)."""
        check_automatic(self.name, self._state, target)
        self._enter(target, "automatic", reason)

    def _enter(self, target: ReplicaState, trigger: str, reason: str) -> None:
        previous, self._state = self._state, target
        self.state_since = trio.current_time()
        self.log.emit(
            ReplicaStateChanged(
                from_state=previous.value,
                to_state=target.value,
                trigger="command" if trigger == "command" else "automatic",
                reason=reason,
            )
        )
        roles, loader = self._roles, self._loader
        assert roles is not None and loader is not None
        if target in LOADING_STATE.values():
            loader.start()
        elif STATE_ROLE.get(target) == "decode":  # a role change to decode: its graphs, before it steps
            loader.prepare_for_decode()
        elif target is S.INACTIVE:
            self.release_weights()
        roles.entered(previous, target)
        self._changed()
        self.post()

    def _loaded(self, model: Model, source: str) -> None:
        """The load finished (main loop): a loading state settles; a NewPrefill replica turns
        RefractoryPrefill; a replica commanded elsewhere meanwhile keeps nothing."""
        state = self._state
        settles_to = STATES[state].settles_to
        roles = self._roles
        assert roles is not None
        if state in LOADING_STATE.values() and settles_to is not None:
            self.move(settles_to, "weights loaded")
        elif state is S.NEW_PREFILL:
            roles.loading_finished()
            self.move(S.REFRACTORY_PREFILL, "weights loaded")
        else:  # commanded elsewhere while loading (e.g. a crash and restart): keep nothing
            self.release_weights()

    def release_weights(self) -> None:
        """Drop the weights: the hold on the node's resident copy, or the replica's own copy."""
        self._host.release(self.name)
        compute = self._compute
        compute.model = None
        if compute.executor is not None:
            compute.executor.release()  # its CUDA graphs go with the weights
        compute.executor = None
        self._weights.released()

    def force_inactive(self, error: BaseException) -> None:
        """After a crash (the supervisor calls this once `run` has ended): record and go `Inactive`."""
        self.last_error = f"{type(error).__name__}: {error}"
        if self._state is not S.INACTIVE:
            self._enter_failed()
        self._changed()

    def _enter_failed(self) -> None:
        previous, self._state = self._state, S.INACTIVE
        self.state_since = trio.current_time()
        self.log.emit(
            ReplicaStateChanged(
                from_state=previous.value,
                to_state=S.INACTIVE.value,
                trigger="automatic",
                reason="replica failed",
            )
        )

    def _lock(self, reason: LockReason) -> list[LockReason]:
        if reason not in self._lock_reasons:
            self._lock_reasons.add(reason)
            used, total = self._pools.kv_usage()
            self.log.emit(ReplicaLocked(reason=reason, used_blocks=used, total_blocks=total))
        return sorted(self._lock_reasons)

    def _unlock(self, reason: LockReason) -> list[LockReason]:
        if reason in self._lock_reasons:
            self._lock_reasons.discard(reason)
            self.log.emit(ReplicaUnlocked(reason=reason, still_locked=bool(self._lock_reasons)))
            self._changed()
        return sorted(self._lock_reasons)

    # ------------------------------------------------------------------ after a failure (the supervisor)
    def clean_up_after(self, error: BaseException) -> tuple[int, int]:
        """Its run raised `error` (the supervisor calls this once `run` has ended): every request it held
        fails with `replica_failed`, every block goes back to its pool (its endpoints are closed: no
        write can still land), the weights go, it is `Inactive` with `last_error`, and its ZigZag
        partners look again at their episode. Returns (requests failed, blocks freed)."""
        failed = 0
        for request in [r for r in self._requests.values() if r.holder == self.name and not r.ended]:
            request.fail("replica_failed", f"replica {self.name} failed: {type(error).__name__}: {error}")
            failed += 1
        freed = self._pools.free_everything()
        self.release_weights()
        self.force_inactive(error)
        for other in self._directory.local():
            other.post()
        return failed, freed

    def _refuse_unhandled(self, how: Literal["stopped", "failed"]) -> None:
        """Refuse, with `replica_failed`, every command its run left unhandled — in the inbox, or behind
        the one that failed it. A run that is cancelled (the replica stopped) calls it as it ends, in the
        step that marks it not running, so a command posted while it ran does not wait out its timeout
        on an inbox nobody reads; after a failure `reset` calls it. Other items of the inbox
        (completions, wake-ups) belong to the run that ended and are dropped."""
        unhandled, self._unhandled = self._unhandled, []
        while True:
            try:
                item = self._inbox.receive_nowait()
            except (trio.WouldBlock, trio.ClosedResourceError, trio.EndOfChannel):
                break
            if isinstance(item, Envelope):
                unhandled.append(item)
        for envelope in unhandled:
            if envelope.done.is_set():
                continue
            envelope.error = CommandRefused(
                "replica_failed",
                f"{self.name} {how} before it handled the {type(envelope.command).__name__} command "
                f"({self.last_error or 'its task ended'})",
            )
            envelope.done.set()

    def reset(self) -> None:
        """Fresh inbox and role state after a failure (the supervisor restarts `run` next).

        Commands the failed run never handled — posted while it unwound, or behind the one that failed it —
        are refused with `replica_failed`, so whoever waits on them hears of the failure at once."""
        self._refuse_unhandled("failed")
        self._mailbox.close()
        self._inbox_send, self._inbox = trio.open_memory_channel[InboxItem](math.inf)
        self._sender_send, self._sender_receive = trio.open_memory_channel[SenderDelivery](math.inf)
        self._new_life()
