"""Replicas of one node without the node: real `Replica` actors (supervised), a real `Fabric` over the
chosen transport, one `ModelHost` — the pieces a weight copy runs through — and a log that keeps every
event in memory. Each replica runs in its own cancel scope, so a test can stop one (`stop`) as if its
process died; leaving the block stops them all and checks that no staging block leaked."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, final

import torch
import trio

from messages.commands import Transition
from messages.control import SourceChoice
from messages.faults import Fault
from messages.log.events import LogEvent, WeightsProgress
from replicas.actor import Replica
from replicas.actor.supervisor import supervise
from replicas.directory import ReplicaDirectory
from replicas.fabric import Fabric
from replicas.faults import FaultHooks
from replicas.loading.copy import CopyTarget
from replicas.model.llama import Model
from replicas.request import ServingRequest
from replicas.settings import ReplicaSettings
from replicas.signals import Changes
from replicas.states import LOADING_STATE, ReplicaState, Role
from replicas.weights import ModelHost
from tests.waiting import wait_until
from transport.kinds import TransportChoice

SERVING_STATE: dict[Role, ReplicaState] = {
    "prefill": ReplicaState.PREFILL,
    "decode": ReplicaState.DECODE,
    "encode": ReplicaState.ENCODE,
}
SETTINGS = ReplicaSettings(kv_pool_blocks=16, embedding_pool_blocks=4, max_batch_tokens=256)
_commands = itertools.count(1)


@final
@dataclass(slots=True)
class EventRecorder:
    """An `EventSink` keeping `(replica, event)` pairs."""

    events: list[tuple[str | None, LogEvent]] = field(default_factory=list)
    replica: str | None = None

    def emit(self, event: LogEvent) -> None:
        self.events.append((self.replica, event))

    def bind(self, *, request_id: str | None = None, replica: str | None = None) -> EventRecorder:
        del request_id
        return EventRecorder(self.events, replica or self.replica)

    def of(self, replica: str, kind: type[Any]) -> list[Any]:
        return [event for name, event in self.events if name == replica and isinstance(event, kind)]

    def progress(self, replica: str) -> list[WeightsProgress]:
        return self.of(replica, WeightsProgress)


@final
class Harness:
    """The replicas (`directory`), their `fabric` and model `host`, and the log."""

    def __init__(
        self,
        settings: ReplicaSettings,
        host: ModelHost,
        fabric: Fabric,
        faults: FaultHooks,
        log: EventRecorder,
        nursery: trio.Nursery,
    ) -> None:
        self.settings, self.host, self.fabric, self.faults = settings, host, fabric, faults
        self.log, self._nursery = log, nursery
        self.directory = ReplicaDirectory()
        self.requests: dict[str, ServingRequest] = {}
        self.changes = Changes()  # the node-wide change signal, one for all its replicas
        self._scopes: dict[str, trio.CancelScope] = {}

    def __getitem__(self, name: str) -> Replica:
        return self.directory[name]

    def target(self, name: str) -> CopyTarget:
        """Replica `name` as a weight copy's target (its weights endpoint, reached inside the actor: a
        test that runs `copy_weights` by itself)."""
        replica = self[name]
        endpoint = replica._pools.weights.endpoint
        assert endpoint is not None, f"{name} is not running"
        return CopyTarget(
            name=name,
            log=replica.log,
            endpoint=endpoint,
            host=self.host,
            fabric=self.fabric,
            faults=self.faults,
            directory=self.directory,
            timeout=self.settings.weights_transfer.progress_timeout,
            changes=self.changes,
        )

    async def start(self, name: str, role: Role) -> Replica:
        replica = Replica(
            name,
            role,
            settings=self.settings,
            host=self.host,
            fabric=self.fabric,
            log=self.log,
            requests=self.requests,
            directory=self.directory,
            returned=lambda request: None,
            changes=self.changes,
            faults=self.faults,
        )
        scope = trio.CancelScope()
        self._scopes[name] = scope

        async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with scope:
                await supervise(replica, task_status=task_status)

        await self._nursery.start(run)
        self.directory.add(replica)
        return replica

    async def load(self, name: str, source: SourceChoice | None = None, *, origin: str = "node") -> None:
        """Command `name` into its role's loading state and wait until it serves."""
        replica = self[name]
        to = LOADING_STATE[replica.role].value
        command = Transition(command_id=f"t{next(_commands)}", to=to, origin=origin, source=source)  # type: ignore[arg-type]
        await replica.ask(command)
        await self.serving(name)

    async def transition(self, name: str, to: str) -> None:
        """Command `name` to state `to` and wait until it is there (or past it, automatically)."""
        replica = self[name]
        await replica.ask(Transition(command_id=f"t{next(_commands)}", to=to))  # type: ignore[arg-type]
        after = {"ShuttingPrefill": "ShuttingNull", "ShuttingDecode": "ShuttingNull"}.get(to, to)
        await wait_until(
            lambda: replica.state.value == after,
            f"{name} to reach {after}",
            30,
            detail=lambda: f"state {replica.state.value}",
        )

    async def serving(self, name: str) -> None:
        replica = self[name]
        target = SERVING_STATE[replica.role]
        await wait_until(
            lambda: replica.state is target,
            f"{name} to reach {target.value}",
            60,
            detail=lambda: f"state {replica.state.value}, last error {replica.last_error}",
        )

    def stop(self, name: str) -> None:
        """Stop replica `name` as if its process died (its endpoints close, its links drop)."""
        self._scopes[name].cancel()

    def leaks(self) -> dict[str, dict[str, int]]:
        return {
            pool: owners for replica in self.directory.local() for pool, owners in replica.leaks().items()
        }


@asynccontextmanager
async def running(
    cache_dir: str,
    replicas: Sequence[tuple[str, Role]],
    *,
    model: str = "tiny",
    transport: TransportChoice = "inproc",
    faults: Iterable[Fault] = (),
    dtype: str = "float32",
    settings: ReplicaSettings = SETTINGS,
) -> AsyncIterator[Harness]:
    host = ModelHost(model, device="cpu", dtype=dtype, cache_dir=cache_dir)  # type: ignore[arg-type]
    log = EventRecorder()
    async with trio.open_nursery() as nursery:
        harness = Harness(settings, host, Fabric(transport), FaultHooks(list(faults)), log, nursery)
        for name, role in replicas:
            await harness.start(name, role)
        try:
            yield harness
        finally:
            nursery.cancel_scope.cancel()
    assert harness.leaks() == {}, harness.leaks()


def model_tensors(model: Model) -> dict[str, torch.Tensor]:
    """Every weight of `model` as it holds them (fused, dense), for a tensor-for-tensor comparison."""
    assert model.final_norm is not None and model.lm_head is not None
    found = {"embed": model.embed_tokens, "norm": model.final_norm, "head": _dense(model.lm_head.weight)}
    for index, layer in enumerate(model.layers):
        assert layer is not None, f"layer {index} is missing"
        found[f"{index}.input_norm"], found[f"{index}.post_norm"] = layer.input_norm, layer.post_norm
        for name in ("qkv", "o", "gate_up", "down"):
            linear = getattr(layer, name)
            found[f"{index}.{name}"] = _dense(linear.weight)
            if linear.bias is not None:
                found[f"{index}.{name}.bias"] = linear.bias
    return found


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_dense() if tensor.layout != torch.strided else tensor


def assert_same_weights(got: Model, expected: Model) -> None:
    mine, theirs = model_tensors(got), model_tensors(expected)
    assert mine.keys() == theirs.keys()
    different = [
        name
        for name in mine
        if mine[name].dtype != theirs[name].dtype
        or mine[name].device != theirs[name].device
        or not torch.equal(mine[name], theirs[name])
    ]
    assert not different, f"weights that differ: {different}"
    assert got.parameter_bytes() == expected.parameter_bytes()


def shares_storage(a: Model, b: Model) -> list[str]:
    """The weights of `a` whose memory is also `b`'s."""
    theirs = {
        tensor.untyped_storage().data_ptr()
        for tensor in model_tensors(b).values()
        if tensor.layout == torch.strided
    }
    return [
        name
        for name, tensor in model_tensors(a).items()
        if tensor.layout == torch.strided and tensor.untyped_storage().data_ptr() in theirs
    ]
