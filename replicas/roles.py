"""What a replica does in each state (DESIGN §6), driven from the actor's main loop.

`RoleWork.advance()` runs after every inbox batch: it applies automatic transitions (loading finished,
shutting drained, flush done) and, when no compute is in flight, starts the next one the state calls
for. At most one compute runs per replica (one executor, one cache); it runs in a worker thread and its
result is applied by the main loop (`Completed`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, final

import trio

from messages.commands import ReserveKV
from messages.events import WeightsProgress
from replicas.decode import DecodeWork
from replicas.encode import EncodeWork
from replicas.inbox import Completed
from replicas.migration import Migrator
from replicas.model import Executor, LoadProgress, Model, ModelInputError
from replicas.prefill import PrefillWork
from replicas.request import ServingRequest
from replicas.states import LOADING_STATE, ReplicaState

if TYPE_CHECKING:
    from replicas.actor import Replica

S = ReplicaState
PREFILL_SERVING = frozenset({S.PREFILL, S.SHUTTING_PREFILL})
DECODE_SERVING = frozenset({S.DECODE, S.SHUTTING_DECODE, S.MUTATING_TO_DECODE})


@final
class RoleWork:
    """The behaviours of one replica; see the module docstring."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.model: Model | None = None
        self.executor: Executor | None = None
        self.busy = False
        self.prefill = PrefillWork(self)
        self.decode = DecodeWork(self)
        self.migrator = Migrator(self)
        self.encode = EncodeWork(self)
        self._loading_started: float | None = None

    @property
    def context_length(self) -> int:
        return self.replica.services.host.config.max_position_embeddings

    # ------------------------------------------------------------------ asked by others
    def submit(self, request: ServingRequest) -> bool:
        state = self.replica.state
        if state is S.PREFILL:
            self.prefill.enqueue(request)
            return True
        if state is S.ENCODE:
            self.encode.enqueue(request)
            return True
        return False

    def reserve_kv(self, command: ReserveKV) -> str:
        return self.decode.reserve(command)

    def flush(self) -> int:
        """Adopt this replica's own queued migrations (only in MutatingToDecode); returns how many."""
        return self.decode.adopt_local(self.migrator.take_unclaimed())

    def queue_lengths(self) -> tuple[int, int]:
        """(work queue, migration queue) as `status` shows them."""
        work = len(self.prefill.queue) + len(self.encode.queue)
        migration = self.migrator.queued + self.decode.queued
        return work, migration

    # ------------------------------------------------------------------ lifecycle
    def start(self, nursery: trio.Nursery) -> None:
        if self.replica.pools.kv is not None:
            nursery.start_soon(self.migrator.run)

    def entered(self, previous: ReplicaState, target: ReplicaState) -> None:
        """Side effects of entering `target` (called by the actor right after the state changed)."""
        if target in LOADING_STATE.values():
            self._start_loading()
        elif target is S.MUTATING_TO_DECODE:
            self.prefill.return_queued("the replica is becoming a decode replica")
        elif target is S.INACTIVE:
            self.release_weights()
        self.migrator.wake()

    def release_weights(self) -> None:
        self.replica.services.host.release(self.replica.name)
        self.model = None
        self.executor = None

    def advance(self) -> None:
        """Automatic moves and the next compute of the current state."""
        replica = self.replica
        state = replica.state
        if state is S.AUS_PREFILL:
            replica.move(S.PREFILL, "revived")
        elif state is S.AUS_DECODE:
            replica.move(S.DECODE, "revived")
        elif state is S.MUTATING_TO_DECODE:
            self.flush()
            if not self.busy and self.migrator.idle and not self.prefill.queue:
                replica.move(S.DECODE, "flush adopted the queued migrations")
        state = replica.state
        self.migrator.wake()
        if state in PREFILL_SERVING:
            self.prefill.cancel_sweep()
        if state in DECODE_SERVING or state in PREFILL_SERVING:
            self.decode.adopt_arrivals()
        if not self.busy:
            self._start_next(state)
        self._check_drained(replica.state)

    def _start_next(self, state: ReplicaState) -> None:
        if state in PREFILL_SERVING:
            self.prefill.start_batch()
        elif state in DECODE_SERVING:
            self.decode.start_step()
        elif state in (S.ENCODE, S.SHUTTING_ENCODE):
            self.encode.start_job()

    def _check_drained(self, state: ReplicaState) -> None:
        if self.busy:
            return
        if state is S.SHUTTING_PREFILL and not self.prefill.queue and self.migrator.idle:
            self.replica.move(S.SHUTTING_NULL, "no unfinished prefills or migrations")
        elif state is S.SHUTTING_DECODE and self.decode.idle:
            self.replica.move(S.SHUTTING_NULL, "no unfinished decodes")
        elif state is S.SHUTTING_ENCODE and self.encode.idle:
            self.replica.move(S.SHUTTING_NULL, "no unfinished encodes")

    # ------------------------------------------------------------------ compute and helpers
    def compute(self, fn: Callable[[], Any], apply: Callable[[Any], None]) -> None:
        """Run `fn` in a worker thread; `apply(result)` then runs in the main loop. One at a time."""
        assert not self.busy, f"{self.replica.name}: a compute is already running"
        assert self.replica.nursery is not None
        self.busy = True

        def done(result: Any) -> None:
            self.busy = False
            apply(result)

        self.replica.nursery.start_soon(self._compute, fn, done)

    async def _compute(self, fn: Callable[[], Any], done: Callable[[Any], None]) -> None:
        # Any other exception propagates out of this helper and fails the replica (the supervisor).
        try:
            result = await trio.to_thread.run_sync(fn)
        except ModelInputError as exc:  # the inputs were refused before any write: `apply` fails them
            self.replica.post(Completed(done, exc))
            return
        self.replica.post(Completed(done, result))

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        """Start a helper task in the replica's nursery (transfers, loading)."""
        assert self.replica.nursery is not None
        self.replica.nursery.start_soon(fn, *args)

    def _start_loading(self) -> None:
        self._loading_started = time.monotonic()
        self.spawn(self._load)

    async def _load(self) -> None:
        replica = self.replica
        started = time.monotonic()

        def progress(step: LoadProgress) -> None:
            trio.from_thread.run_sync(
                replica.log.emit,
                WeightsProgress(
                    layers_loaded=step.loaded_layers,
                    layers_total=step.total_layers,
                    seconds=time.monotonic() - started,
                ),
            )

        # A bad checkpoint raises out of this helper: the replica fails with the loader's message.
        model = await replica.services.host.acquire(replica.name, progress)
        replica.post(Completed(self._loaded, model))

    def _loaded(self, model: Model) -> None:
        self.model = model
        kv = self.replica.pools.kv
        self.executor = None if kv is None else Executor(model, kv)
        target = {S.LOADING_PREFILL: S.PREFILL, S.LOADING_DECODE: S.DECODE, S.LOADING_ENCODE: S.ENCODE}
        state = self.replica.state
        if state in target:
            self.replica.move(target[state], "weights loaded")
        else:  # commanded elsewhere while loading (e.g. a crash and restart): keep nothing
            self.release_weights()
