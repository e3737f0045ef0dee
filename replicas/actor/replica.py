"""The replica actor (architecture §6): one Trio task that owns all of a replica's state.

A replica is closed. Others read its `snapshot()` (a frozen `ReplicaSnapshot`: state, lock, queues,
blocks, weights, executor) and send it commands — `ask` / `tell` a `ReplicaCommand`, `submit` a request
to its work queue, `post` a wake-up; nothing outside it touches its queues, pools or role objects.

Everything that reaches a replica goes through its *inbox*: commands (`messages.commands`), the
transfer protocol's sender-bound messages, and the completions of its own helpers. The main loop drains
the inbox (`replicas.actor.intake`) — commands first (`replicas.actor.dispatch`) — then, once per pass,
lets the current state's roles (`replicas.actor.roles`) do their upkeep, applies the one automatic move
the table of `replicas.actor.moves` finds due, and starts at most one compute (a prefill batch, a decode
step, an encode job) in a worker thread, and sleeps until the next item. It never blocks on compute, so control is never stuck
behind work; and it is the only writer of the state: helpers (the migrator, transfers, loading) post
their outcomes to the inbox.

Each run of the task gets fresh parts, built from its opened endpoints (`replicas.actor.wiring`); what a
part of an earlier run (before a failure and restart) still posts or spawns is dropped. The state, its
locks and the last error have one writer (`replicas.actor.transitions`); what a failed run leaves is
cleaned up by `replicas.actor.recovery`.

Cancellation: cancelling `run` cancels the replica's nursery — transfers abort (their blocks return to
the pools through the transport's shielded cleanup), a compute in a worker thread finishes (threads are
never abandoned) and its result is dropped. Any other exception ends `run`; the supervisor then fails
the replica's requests and frees its blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any, final

import trio

from messages.cluster import MAX_PREFIX_KEYS, PrefixDelta
from messages.commands import ReplicaCommand
from messages.control import LockReason, WeightsSource
from replicas.actor.dispatch import handle
from replicas.actor.intake import Inbox
from replicas.actor.loader import release_weights
from replicas.actor.moves import WAITS_FOR_WEIGHTS, due
from replicas.actor.pools import EncodePools, LanguagePools
from replicas.actor.recovery import recover
from replicas.actor.transitions import Lifecycle, missing_pool
from replicas.actor.wiring import Mailbox, Run, Wiring, open_run
from replicas.fabric import Fabric
from replicas.faults import NO_FAULTS, FaultHooks
from replicas.inbox import CommandRefused, Envelope, InboxItem
from replicas.loading.progress import WeightsStatus
from replicas.model import Model
from replicas.ports import Directory, EventSink, LiveRequests, NodeSignal
from replicas.request import ServingRequest
from replicas.settings import ReplicaSettings
from replicas.snapshot import ReplicaSnapshot
from replicas.states import LOADING_STATE, SERVING_ROLE, STATE_ROLE, ReplicaState, Role
from replicas.step.compute import Compute
from replicas.weights import ModelHost

S = ReplicaState


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
        self.log = log.bind(replica=name)
        self._wiring = Wiring(
            name=name,
            log=self.log,
            settings=settings,
            host=host,
            fabric=fabric,
            requests=requests,
            directory=directory,
            returned=returned,
            changes=changes,
            faults=faults,
        )
        self._lifecycle = Lifecycle(name, self.log, changes.notify, self._entered)
        config, device = host.config, host.device
        self._pools: LanguagePools | EncodePools
        if role == "encode":
            self._pools = EncodePools(name, config, settings, device)
        else:
            landing = config.image_token_id is not None and role == "prefill"
            self._pools = LanguagePools(name, config, settings, device, landing=landing)
        self._inbox = Inbox(name)
        self._new_life()

    def _new_life(self) -> None:
        """Fresh per-run parts: the mailbox, the compute slot, the weights status (the rest with `run`)."""
        host = self._wiring.host
        self._mailbox = Mailbox(self)
        self._compute = Compute(self._mailbox, host.config, self._wiring.settings.emulated)
        self._weights = WeightsStatus(host.config.num_layers)
        self._run: Run | None = None
        self._weights_endpoint_open = False

    # ------------------------------------------------------------------ what others may read
    @property
    def state(self) -> ReplicaState:
        return self._lifecycle.state

    @property
    def state_since(self) -> float:
        """When it entered `state` (Trio's clock)."""
        return self._lifecycle.since

    @property
    def last_error(self) -> str | None:
        return self._lifecycle.last_error

    @property
    def lock_reasons(self) -> frozenset[LockReason]:
        return self._lifecycle.lock_reasons

    @property
    def locked(self) -> bool:
        """Non-decode replicas are always locked; a decode replica while any lock reason holds."""
        return self._lifecycle.locked

    @property
    def model(self) -> Model | None:
        """The weights it serves now (None: none loaded)."""
        return self._compute.model

    def snapshot(self) -> ReplicaSnapshot:
        """Its state and load now (see `replicas.snapshot`)."""
        pools, run, executor = self._pools, self._run, self._compute.executor
        used_kv, total_kv = pools.kv_usage()
        facts = None if run is None else run.roles.facts()
        model = self._compute.model
        state = self.state
        return ReplicaSnapshot(
            name=self.name,
            role=self.role,
            state=state,
            serving_role=SERVING_ROLE.get(state) or self.role,
            locked=self.locked,
            lock_reasons=tuple(sorted(self.lock_reasons)),
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
        self._inbox.post(item)

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
                f"(state {self.state.value}; last error: {self.last_error})",
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
        run = self._run
        if self._mailbox.nursery is None or run is None:
            return False
        accepted = run.roles.submit(request)
        if accepted:
            self.post()
        return accepted

    # ------------------------------------------------------------------ the task
    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled (see the module docstring)."""
        async with AsyncExitStack() as stack:
            mailbox = self._mailbox
            self._run = run = await open_run(
                stack,
                self._wiring,
                pools=self._pools,
                mailbox=mailbox,
                compute=self._compute,
                weights=self._weights,
                sender=self._inbox.sender,
                loaded=self._loaded,
            )
            nursery = mailbox.nursery
            assert nursery is not None
            self._weights_endpoint_open = True
            nursery.start_soon(self._inbox.forward_sender_messages)
            run.roles.start()
            task_status.started()
            stopped = False
            try:
                await self._main_loop(run)
            except trio.Cancelled:
                stopped = True
                raise
            finally:
                self._weights_endpoint_open = False
                mailbox.nursery = None
                nursery.cancel_scope.cancel()
                if stopped:  # in the same step: nothing posted while it ran waits on a closed inbox
                    self._inbox.refuse_unhandled("stopped", self.last_error)

    async def _main_loop(self, run: Run) -> None:
        while True:
            envelopes, completions = await self._inbox.batch()
            # Commands first, then completions: control is never stuck behind work.
            for index, envelope in enumerate(envelopes):
                try:
                    self._handle(envelope, run)
                except BaseException:
                    self._inbox.leave(envelopes[index + 1 :])  # refused by `reset`
                    raise
            for completed in completions:
                if completed.error is not None:
                    raise completed.error
                completed.apply(completed.result)
            self._wiring.faults.loop_step(self.name, self.log)
            self._pass(run)

    def _pass(self, run: Run) -> None:
        """After every inbox batch: the state's upkeep, the automatic move due now (the one table of
        `replicas.actor.moves`, evaluated once), and the next compute of the state it is in then."""
        roles = run.roles
        roles.tend()
        move = due(self.state, roles.progress(self._lifecycle.weights_landed))
        if move is not None:
            self._lifecycle.move(*move)
        roles.start_next()

    def _handle(self, envelope: Envelope, run: Run) -> None:
        handle(
            envelope,
            run=run,
            lifecycle=self._lifecycle,
            pools=self._pools,
            settings=self._wiring.settings,
            model=self._compute.model,
            weights=self._weights,
            missing=self._missing_pool,
            configured=self.role,
        )

    def _missing_pool(self, target: ReplicaState) -> str | None:
        pools = self._pools
        kv = isinstance(pools, LanguagePools)
        landing = isinstance(pools, LanguagePools) and pools.emb is not None
        vision = self._wiring.host.config.image_token_id is not None
        return missing_pool(self.role, target, kv=kv, landing=landing, vision=vision)

    # ------------------------------------------------------------------ entering a state
    def _entered(self, previous: ReplicaState, target: ReplicaState) -> None:
        """What entering `target` starts (`Lifecycle` calls it, in the main loop): a load, the decode
        graphs of a role change, dropping the weights; then the roles' part, and the change signal."""
        run = self._run
        assert run is not None
        if target in LOADING_STATE.values():
            run.loader.start()
        elif STATE_ROLE.get(target) == "decode":  # a role change to decode: its graphs, before it steps
            run.loader.prepare_for_decode()
        elif target is S.INACTIVE:
            self._release_weights()
        run.roles.entered(previous, target)
        self._wiring.changes.notify()
        self.post()

    def _loaded(self, model: Model, source: WeightsSource) -> None:
        """The load finished (main loop): a state that waited for it moves on in this pass (a loading
        state settles, a NewPrefill replica turns RefractoryPrefill); a replica commanded elsewhere
        meanwhile keeps nothing."""
        if self.state in WAITS_FOR_WEIGHTS:
            self._lifecycle.landed()
        else:  # commanded elsewhere while loading (e.g. a crash and restart): keep nothing
            self._release_weights()

    def _release_weights(self) -> None:
        release_weights(self._wiring.host, self.name, self._compute, self._weights)

    # ------------------------------------------------------------------ after a failure (the supervisor)
    def clean_up_after(self, error: BaseException) -> tuple[int, int]:
        """Its run raised `error` (the supervisor calls this once `run` has ended): see
        `replicas.actor.recovery`. Returns (requests failed, blocks freed)."""
        wiring = self._wiring
        return recover(
            error,
            name=self.name,
            requests=wiring.requests,
            pools=self._pools,
            release_weights=self._release_weights,
            lifecycle=self._lifecycle,
            directory=wiring.directory,
        )

    def reset(self) -> None:
        """Fresh inbox and parts after a failure (the supervisor restarts `run` next).

        Commands the failed run never handled — posted while it unwound, or behind the one that failed it —
        are refused with `replica_failed`, so whoever waits on them hears of the failure at once."""
        self._inbox.refuse_unhandled("failed", self.last_error)
        self._mailbox.close()
        self._inbox.renew()
        self._new_life()
