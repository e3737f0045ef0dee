"""Loading a replica's weights and building its executor (architecture §8), for the actor.

On entering a `Loading*` state the actor calls `start`: a helper task shares the node's resident copy
(`ModelHost.acquire`) or loads the replica's own copy from the source its `Transition` named
(`replicas.loading.copy`), handing the partly loaded `Model` over as soon as the embeddings landed (a
ZigZag replica serves its leading layers). The executor is built in a worker thread; a decode replica
captures its decode graphs before it serves (`Executor.prepare`). A prefill replica that becomes a
decode replica captures them on entering `MutatingToDecode` (or `AusDecode`, revived as decode) with
`prepare_for_decode`, and does not step before they are ready: graphs are captured at the load or at the
role change, never inside a step. When the load is done, `loaded` (given by the
actor) moves the replica on; the layers an own copy installed plain are then packed for the CPU's faster
kernels in the background (`_pack`), the replica serving them plain meanwhile.

Cancellation: the helpers run in the actor's nursery; a capture in a worker thread runs to its end.
A load's failure raises out of its helper: the replica fails with its message.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import final

import structlog
import trio

from messages.control import SourceChoice, WeightsSource
from messages.log.events import WeightsProgress
from messages.log.scaling import ExecutorReady
from replicas.loading.copy import CopyTarget, copy_weights
from replicas.loading.progress import PieceLoaded, WeightsStatus
from replicas.model import Executor, KVCache, Model
from replicas.model.layers import packed_layer
from replicas.ports import Actor
from replicas.settings import ReplicaSettings
from replicas.states import ReplicaState
from replicas.step.compute import Compute
from replicas.weights import ModelHost

S = ReplicaState
_log = structlog.get_logger("replicas.loading")


@final
class Loader:
    """See the module docstring. `kv`: the KV cache an executor runs on (None: an encode replica, which
    needs none); `loaded(model, source)` is called in the main loop once the load is done."""

    def __init__(
        self,
        actor: Actor,
        *,
        compute: Compute,
        weights: WeightsStatus,
        host: ModelHost,
        settings: ReplicaSettings,
        kv: KVCache | None,
        target: CopyTarget,
        loaded: Callable[[Model, WeightsSource], None],
        changed: Callable[[], None],
    ) -> None:
        self._actor = actor
        self._compute = compute
        self._weights = weights
        self._host = host
        self._settings = settings
        self._kv = kv
        self._target = target
        self._loaded = loaded
        self._changed = changed  # the node-wide change signal: a replica chained after it waits on it
        self.preparing = False  # decode graphs being captured for a role change

    def start(self) -> None:
        self._actor.spawn(self._load, self._weights.loading())

    async def _load(self, source: SourceChoice | None) -> None:
        """Load the weights: share the node's resident copy (`source` None), or load the replica's own
        copy from `source`, handing its `Model` over as soon as the embeddings landed. A failure raises
        out of this helper: the replica fails with its message (a bad checkpoint; `WeightCopyFailed`,
        naming the source, the piece and why)."""
        actor = self._actor
        if source is not None:

            def hand_over(model: Model) -> None:  # main loop: the loaded leading layers may serve (ZigZag)
                if self._compute.model is None:
                    self._compute.model = model
                    self._compute.executor = None if self._kv is None else self._new_executor(model, self._kv)

            def own_piece(piece: PieceLoaded) -> None:  # main loop
                self._weights.landed(piece, shared=False)
                self._changed()

            outcome = await copy_weights(
                self._target,
                source,
                upstream=self._weights.upstream,
                on_model=lambda model: actor.later(lambda: hand_over(model)),
                on_piece=lambda piece: actor.later(lambda: own_piece(piece)),
                emulated=self._settings.emulated,
            )
            executor = await self._prepared(outcome.model)
            actor.later(lambda: self._done(outcome.model, outcome.source, executor))
            actor.spawn(self._pack, outcome.model)
            return
        started = time.monotonic()

        def landed(piece: PieceLoaded) -> None:  # main loop
            actor.log.emit(
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
            self._weights.landed(piece, shared=True)

        def progress(piece: PieceLoaded) -> None:  # in the loading worker thread
            trio.from_thread.run_sync(landed, piece)

        model = await self._host.acquire(actor.name, progress)
        executor = await self._prepared(model)
        actor.later(lambda: self._done(model, "resident", executor))

    async def _pack(self, model: Model) -> None:
        """Pack the layers a copy installed plain for the CPU's faster kernels (`packed_layer`), one at a
        time in a worker thread, while the replica serves them plain: each layer is swapped whole, so a
        step sees it either plain or packed (an exact reordering). Stops when the replica let the model
        go. Cancellation: the layer in the thread is packed to its end, then `Cancelled` propagates."""
        started, packed = time.monotonic(), 0
        for index, layer in enumerate(model.layers):
            if self._compute.model is not model:
                return
            if layer is None:
                continue
            new = await trio.to_thread.run_sync(packed_layer, layer, model.kernels)
            if new is not None and model.layers[index] is layer:
                model.set_layer(index, new)
                packed += 1
        if packed:
            _log.info(
                "weights.packed", replica=self._actor.name, layers=packed, seconds=time.monotonic() - started
            )

    def _new_executor(self, model: Model, kv: KVCache) -> Executor:
        """An executor of `model` on the replica's KV cache, run as the node's `[executor]` says."""
        settings = self._settings
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
        load ends its relay episode): it captures them if it becomes a decode replica
        (`prepare_for_decode`). None without a KV cache (encode). Cancellation: the capture runs to its
        end (threads are never abandoned)."""
        kv = self._kv
        if kv is None:
            return None
        started = time.monotonic()
        executor = await trio.to_thread.run_sync(self._new_executor, model, kv)
        if executor.needs_prepare and self._actor.state is S.LOADING_DECODE:
            await trio.to_thread.run_sync(executor.prepare)
        self._actor.log.emit(
            ExecutorReady(
                path=executor.path,
                graph_batches=executor.graph_batches,
                seconds=time.monotonic() - started,
                fallbacks=list(executor.fallbacks),
            )
        )
        return executor

    def _done(self, model: Model, source: WeightsSource, executor: Executor | None) -> None:
        self._weights.loaded(model, source)
        if executor is not None:
            self._compute.executor = executor
        self._compute.model = model
        self._loaded(model, source)

    def prepare_for_decode(self) -> None:
        """The replica turns decode (`MutatingToDecode`, `AusDecode`): capture the decode graphs its
        executor wants, in a worker thread, before its first decode step (`preparing` until then; the
        move on to `Decode` waits for it). Nothing to do without an executor or graphs to capture."""
        executor = self._compute.executor
        if executor is None or not executor.needs_prepare or self.preparing:
            return
        self.preparing = True
        self._actor.spawn(self._prepare, executor)

    async def _prepare(self, executor: Executor) -> None:
        started = time.monotonic()
        await trio.to_thread.run_sync(executor.prepare)
        self._actor.log.emit(
            ExecutorReady(
                path=executor.path,
                graph_batches=executor.graph_batches,
                seconds=time.monotonic() - started,
                fallbacks=list(executor.fallbacks),
            )
        )
        self._actor.later(self._prepared_for_decode)

    def _prepared_for_decode(self) -> None:
        self.preparing = False


def release_weights(host: ModelHost, name: str, compute: Compute, weights: WeightsStatus) -> None:
    """Drop replica `name`'s weights: its hold on the node's resident copy, or its own copy, with the
    executor (its CUDA graphs go with the weights)."""
    host.release(name)
    compute.model = None
    if compute.executor is not None:
        compute.executor.release()
    compute.executor = None
    weights.released()
