"""Executing a step: the replica's model and executor, one call at a time, in a worker thread
(architecture §6).

`model` and `executor` are the weights the replica serves now and the executor over its KV cache (None
while nothing is loaded; an encode replica has no executor); the loader sets them.

`Compute.run(call, done, refused)` runs `call()` with `trio.to_thread.run_sync` in a helper task of the
replica and, in the replica's main loop, applies the result with `done(output)` — or `refused(error)`
when the model refused the inputs (`ModelInputError`: raised before anything was written). Any other
exception fails the replica (its supervisor). With an emulated duration (`replicas.emulation`) the
result is applied no earlier than that many seconds after the call was asked for, and the node's
emulated calls take the host's cores one at a time (`host_cores`): each real compute runs with every
core, as on an accelerator of its own, instead of several replicas' threads thrashing the same cores;
a call waiting its turn is still due at its emulated time.

Invariants: at most one call runs (`busy` from `run` until its result is applied); the result is applied
in the main loop, never in the helper. Cancellation: a call in a worker thread runs to its end (threads
are never abandoned); its result is then dropped with the stale run it belonged to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, final

import trio

from replicas.emulation import EmulatedSpeed
from replicas.model import Executor, Model, ModelConfig, ModelInputError
from replicas.ports import Actor

Out = TypeVar("Out")
V = TypeVar("V")

_HOST_CORES: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("emulated_host_cores")


def host_cores() -> trio.CapacityLimiter:
    """The node's one slot for emulated compute (one per Trio run: every replica of the node shares it)."""
    try:
        return _HOST_CORES.get()
    except LookupError:
        limiter = trio.CapacityLimiter(1)
        _HOST_CORES.set(limiter)
        return limiter


@final
class Compute:
    """The compute slot of one replica's run (see the module docstring)."""

    def __init__(self, actor: Actor, config: ModelConfig, emulated: EmulatedSpeed) -> None:
        self._actor = actor
        self.config = config
        self._emulated = emulated
        self.model: Model | None = None
        self.executor: Executor | None = None
        self.busy = False

    @property
    def context_length(self) -> int:
        return self.config.max_position_embeddings

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def emulated_prefill(self, tokens: int, layers: int) -> float | None:
        """The emulated duration of `tokens` prompt tokens through `layers` layers (None: not emulated);
        the head is counted with the last layer."""
        return self._emulated.prefill_seconds(tokens, layers, self.config.num_layers)

    def emulated_decode(self) -> float | None:
        return self._emulated.decode_seconds()

    def run(
        self,
        call: Callable[[], Out],
        done: Callable[[Out], None],
        refused: Callable[[ModelInputError], None],
        *,
        emulated: float | None = None,
    ) -> None:
        assert not self.busy, f"{self._actor.name}: a compute is already running"
        self.busy = True
        self._actor.spawn(self._call, call, done, refused, emulated)

    async def _call(
        self,
        call: Callable[[], Out],
        done: Callable[[Out], None],
        refused: Callable[[ModelInputError], None],
        emulated: float | None,
    ) -> None:
        started = trio.current_time()
        limiter = None if emulated is None else host_cores()
        try:
            output = await trio.to_thread.run_sync(call, limiter=limiter)
        except ModelInputError as error:  # the inputs were refused before any write
            failure = error
            await self._pad(started, emulated)
            self._actor.later(lambda: self._apply(refused, failure))
            return
        await self._pad(started, emulated)
        self._actor.later(lambda: self._apply(done, output))

    @staticmethod
    async def _pad(started: float, emulated: float | None) -> None:
        if emulated is not None:
            await trio.sleep_until(started + emulated)

    def _apply(self, apply: Callable[[V], None], value: V) -> None:
        self.busy = False
        apply(value)
