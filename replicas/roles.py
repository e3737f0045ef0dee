"""What a replica does in each state (architecture §6), driven from the actor's main loop.

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
from messages.control import SourceChoice, WeightsSource
from messages.log.events import WeightsProgress
from messages.log.scaling import ExecutorReady
from replicas.decode import DecodeWork
from replicas.encode import EncodeWork
from replicas.inbox import Completed
from replicas.loading.copy import copy_weights
from replicas.loading.progress import PieceLoaded, WeightsStatus
from replicas.model import Executor, Model, ModelInputError
from replicas.model.gpu.options import ExecutorPath
from replicas.prefill import PrefillWork
from replicas.prefill.migration import Migrator
from replicas.request import ServingRequest
from replicas.states import (
    DECODE_STEPS,
    ENCODE_JOBS,
    LOADING_STATE,
    PREFILL_BATCHES,
    STATES,
    ZIGZAG_NEW,
    ReplicaState,
)
from replicas.zigzag.new_prefill import NewPrefillWork
from replicas.zigzag.old_prefill import OldPrefillWork

if TYPE_CHECKING:
    from replicas.actor import Replica
    from replicas.model import KVCache

S = ReplicaState


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
        self.new_prefill = NewPrefillWork(self)
        self.old_prefill = OldPrefillWork(self)
        self._loading_started: float | None = None
        self.weights = WeightsStatus(replica.services.host.config.num_layers)  # replicas.loading

    @property
    def context_length(self) -> int:
        return self.replica.services.host.config.max_position_embeddings

    # ------------------------------------------------------------------ asked by others
    def submit(self, request: ServingRequest) -> bool:
        state = self.replica.state
        if state is S.PREFILL or (state is S.OLD_PREFILL and self.old_prefill.takes_new_work()):
            self.prefill.enqueue(request)
            return True
        if state is S.NEW_PREFILL and self.new_prefill.accepts(request):
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
        work = len(self.prefill.queue) + len(self.encode.queue) + len(self.new_prefill.batches)
        migration = self.migrator.queued + self.decode.queued
        return work, migration

    # ------------------------------------------------------------------ lifecycle
    def start(self, nursery: trio.Nursery) -> None:
        if self.replica.pools.kv is not None:
            nursery.start_soon(self.migrator.run)

    def paired_with(self) -> list[str]:
        """The replicas this one relays with now (ZigZag); [] outside an episode."""
        state = self.replica.state
        if state in ZIGZAG_NEW:
            return list(self.new_prefill.partners)
        if state is S.OLD_PREFILL:
            return list(self.old_prefill.partners)
        return []

    def paired(self, target: ReplicaState, partner: str | None) -> None:
        """A commanded NewPrefill / OldPrefill move named (or added) the replica it relays with."""
        if target is S.NEW_PREFILL:
            self.new_prefill.entered(partner)
        elif target is S.OLD_PREFILL:
            self.old_prefill.pair(partner)

    def entered(self, previous: ReplicaState, target: ReplicaState) -> None:
        """Side effects of entering `target` (called by the actor right after the state changed)."""
        if previous in ZIGZAG_NEW and target not in ZIGZAG_NEW:
            self.new_prefill.wake_partners()  # an OldPrefill partner may end its episode
        if target in LOADING_STATE.values():
            self._start_loading()
        elif target is S.MUTATING_TO_DECODE:
            self.prefill.return_queued("the replica is becoming a decode replica")
        elif target is S.INACTIVE:
            self.release_weights()
        self.migrator.wake()

    def release_weights(self) -> None:
        """Drop the weights: the hold on the node's resident copy, or the replica's own copy."""
        self.replica.services.host.release(self.replica.name)
        self.model = None
        if self.executor is not None:
            self.executor.release()  # its CUDA graphs go with the weights
        self.executor = None
        self.weights.released()

    # ------------------------------------------------------------------ weights, as `status` shows them
    @property
    def executor_path(self) -> ExecutorPath | None:
        """How the replica runs the model (graphs, kernels, eager); None without an executor."""
        return None if self.executor is None else self.executor.path

    @property
    def executor_fallbacks(self) -> list[str]:
        return [] if self.executor is None else list(self.executor.fallbacks)

    @property
    def weights_source(self) -> WeightsSource | None:
        return self.weights.source

    @property
    def loaded_layers(self) -> int:
        return self.weights.loaded_layers

    @property
    def total_layers(self) -> int:
        return self.weights.total_layers

    @property
    def weights_bytes_loaded(self) -> int:
        return self.weights.bytes_loaded

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
        elif state is S.REFRACTORY_PREFILL and self.new_prefill.idle and not self.busy:
            replica.move(S.PREFILL, "every ZigZag batch finished or handed over")
        elif state is S.OLD_PREFILL and self.old_prefill.episode_over() and not self._relay_running():
            replica.move(S.PREFILL, "no relays left")
        state = replica.state
        self.migrator.wake()
        if state in PREFILL_BATCHES or state is S.NEW_PREFILL:
            self.prefill.cancel_sweep()
        if state is S.OLD_PREFILL:
            self.old_prefill.maybe_ask()
        if state in DECODE_STEPS or state in PREFILL_BATCHES:
            self.decode.adopt_arrivals()
        if not self.busy:
            self._start_next(state)
        self._check_drained(replica.state)

    def _relay_running(self) -> bool:
        return self.busy and self.old_prefill.running is not None

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
        elif state in ENCODE_JOBS:
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
    def compute(
        self, fn: Callable[[], Any], apply: Callable[[Any], None], *, emulated: float | None = None
    ) -> None:
        """Run `fn` in a worker thread; `apply(result)` then runs in the main loop. One at a time.
        `emulated`: pad the compute to this many seconds (`replicas.emulation`)."""
        assert not self.busy, f"{self.replica.name}: a compute is already running"
        assert self.replica.nursery is not None
        self.busy = True

        def done(result: Any) -> None:
            self.busy = False
            apply(result)

        self.replica.nursery.start_soon(self._compute, fn, done, emulated)

    async def _compute(
        self, fn: Callable[[], Any], done: Callable[[Any], None], emulated: float | None
    ) -> None:
        # Any other exception propagates out of this helper and fails the replica (the supervisor).
        started = trio.current_time()
        try:
            result: Any = await trio.to_thread.run_sync(fn)
        except ModelInputError as exc:  # the inputs were refused before any write: `apply` fails them
            result = exc
        if emulated is not None:
            await trio.sleep_until(started + emulated)
        self.replica.post(Completed(done, result))

    def emulated_prefill(self, tokens: int, layers: int) -> float | None:
        """The emulated duration of `tokens` prompt tokens through `layers` layers (None: not emulated);
        the head is counted with the last layer."""
        config = self.replica.services.host.config
        return self.replica.services.settings.emulated.prefill_seconds(tokens, layers, config.num_layers)

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        """Start a helper task in the replica's nursery (transfers, loading)."""
        assert self.replica.nursery is not None
        self.replica.nursery.start_soon(fn, *args)

    def _start_loading(self) -> None:
        self._loading_started = time.monotonic()
        self.spawn(self._load, self.weights.loading())

    async def _load(self, source: SourceChoice | None) -> None:
        """Load the weights: share the node's resident copy (`source` None), or load the replica's own
        copy from `source` (`replicas.loading.copy`), handing its `Model` over as soon as the embeddings
        landed. A failure raises out of this helper: the replica fails with its message (a bad
        checkpoint; `WeightCopyFailed`, naming the source, the piece and why)."""
        replica = self.replica
        if source is not None:

            def hand_over(model: Model) -> None:  # main loop: the loaded leading layers may serve (ZigZag)
                if self.model is None:
                    kv = replica.pools.kv
                    self.model, self.executor = model, None if kv is None else self.new_executor(model, kv)

            def own_piece(piece: PieceLoaded) -> None:  # main loop
                self.weights.landed(piece, shared=False)

            outcome = await copy_weights(
                replica,
                source,
                on_model=lambda model: replica.post(Completed(hand_over, model)),
                on_piece=lambda piece: replica.post(Completed(own_piece, piece)),
                emulated=replica.services.settings.emulated,
            )
            executor = await self._prepared(outcome.model)
            replica.post(Completed(self._loaded, (outcome.model, outcome.source, executor)))
            return
        started = time.monotonic()

        def landed(piece: PieceLoaded) -> None:  # main loop
            replica.log.emit(
                WeightsProgress(
                    layers_loaded=piece.loaded_layers,
                    layers_total=piece.total_layers,
                    seconds=time.monotonic() - started,
                    piece=piece.piece.kind,
                    layer=piece.piece.layer,
                    bytes=piece.bytes,
                    piece_seconds=piece.seconds,
                    weights_source=piece.source,
                    bytes_loaded=piece.bytes_loaded,
                )
            )
            self.weights.landed(piece, shared=True)

        def progress(piece: PieceLoaded) -> None:  # in the loading worker thread
            trio.from_thread.run_sync(landed, piece)

        model = await replica.services.host.acquire(replica.name, progress)
        executor = await self._prepared(model)
        replica.post(Completed(self._loaded, (model, "resident", executor)))

    def new_executor(self, model: Model, kv: KVCache) -> Executor:
        """An executor of `model` on the replica's KV cache, run as the node's `[executor]` says."""
        settings = self.replica.services.settings
        return Executor(
            model,
            kv,
            attention=settings.attention,
            cuda_graphs=settings.cuda_graphs,
            max_batch=settings.max_batch_size,
        )

    async def _prepared(self, model: Model) -> Executor | None:
        """A new executor of the whole `model` — for a decode replica with its decode graphs captured, in a
        worker thread (seconds on a GPU; the replica serves nothing new meanwhile, its state is still a
        loading one). A prefill replica does not wait for graphs it may never use (a ZigZag replica's
        load ends its relay episode): if it becomes a decode replica, its first decode step captures them.
        None without a KV cache (encode). Cancellation: the capture runs to its end (threads are never
        abandoned)."""
        kv = self.replica.pools.kv
        if kv is None:
            return None
        started = time.monotonic()
        executor = await trio.to_thread.run_sync(self.new_executor, model, kv)
        if executor.needs_prepare and self.replica.state is S.LOADING_DECODE:
            await trio.to_thread.run_sync(executor.prepare)
        self.replica.log.emit(
            ExecutorReady(
                path=executor.path,
                graph_batches=executor.graph_batches,
                seconds=time.monotonic() - started,
                fallbacks=list(executor.fallbacks),
            )
        )
        return executor

    def _loaded(self, loaded: tuple[Model, WeightsSource, Executor | None]) -> None:
        model, source, executor = loaded
        self.weights.loaded(model, source)
        if executor is not None:
            self.executor = executor
        self.model = model
        state = self.replica.state
        settles_to = STATES[state].settles_to
        if state in LOADING_STATE.values() and settles_to is not None:
            self.replica.move(settles_to, "weights loaded")
        elif state is S.NEW_PREFILL:
            self.new_prefill.loading_finished()
            self.replica.move(S.REFRACTORY_PREFILL, "weights loaded")
        else:  # commanded elsewhere while loading (e.g. a crash and restart): keep nothing
            self.release_weights()
