"""The parts of one run of a replica, built from its opened endpoints (architecture §6).

Each run of the actor's task opens the replica's transfer endpoints and its nursery and builds, from
them, a fresh `Run`: the mailbox its parts post and spawn through, the weights loader, and the roles of
the replica's kind (`LanguageRoles` with a KV cache, `EncodeRoles` with an encoder output pool). A part
of an earlier run keeps the mailbox of its own run, closed when that run ended (`Mailbox.close`): what
it still posts or spawns is dropped, so a stale part never reaches the next run.

`Wiring` is what the node gives the replica once — every run is built from it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, Protocol, final

import trio

from messages.control import WeightsSource
from replicas.actor.loader import Loader
from replicas.actor.pools import EncodeEndpoints, EncodePools, LanguageEndpoints, LanguagePools
from replicas.actor.roles import EncodeRoles, LanguageRoles, Roles
from replicas.fabric import Fabric
from replicas.faults import FaultHooks
from replicas.inbox import Completed, InboxItem
from replicas.loading.copy import CopyTarget
from replicas.loading.progress import WeightsStatus
from replicas.model import Model
from replicas.ports import Directory, EventSink, LiveRequests, NodeSignal
from replicas.request import ServingRequest
from replicas.settings import ReplicaSettings
from replicas.states import ReplicaState
from replicas.step.compute import Compute
from replicas.weights import ModelHost
from transport.endpoint import SenderDelivery


class _Owner(Protocol):
    """The replica a mailbox belongs to."""

    @property
    def name(self) -> str: ...

    @property
    def log(self) -> EventSink: ...

    @property
    def state(self) -> ReplicaState: ...

    def post(self, item: InboxItem = None) -> None: ...


@final
class Mailbox:
    """What the parts of one run of a replica post and spawn through (`replicas.ports.Actor`); once the
    run is over (`close`) it drops everything, so a stale part cannot reach the next run."""

    def __init__(self, owner: _Owner) -> None:
        self._owner = owner
        self.nursery: trio.Nursery | None = None
        self.closed = False

    @property
    def name(self) -> str:
        return self._owner.name

    @property
    def log(self) -> EventSink:
        return self._owner.log

    @property
    def state(self) -> ReplicaState:
        return self._owner.state

    def post(self, item: InboxItem = None) -> None:
        if not self.closed:
            self._owner.post(item)

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
@dataclass(frozen=True, slots=True)
class Wiring:
    """What the node gives a replica (see `replicas.actor.Replica`): every run is built from it."""

    name: str
    log: EventSink
    settings: ReplicaSettings
    host: ModelHost
    fabric: Fabric
    requests: LiveRequests
    directory: Directory
    returned: Callable[[ServingRequest], None]
    changes: NodeSignal
    faults: FaultHooks


@final
@dataclass(frozen=True, slots=True)
class Run:
    """The parts of one run (see the module docstring)."""

    mailbox: Mailbox
    endpoints: LanguageEndpoints | EncodeEndpoints
    loader: Loader
    roles: Roles


async def open_run(
    stack: AsyncExitStack,
    wiring: Wiring,
    *,
    pools: LanguagePools | EncodePools,
    mailbox: Mailbox,
    compute: Compute,
    weights: WeightsStatus,
    sender: trio.MemorySendChannel[SenderDelivery],
    loaded: Callable[[Model, WeightsSource], None],
) -> Run:
    """Open the run's endpoints (their senders' protocol messages go to `sender`) and nursery on `stack`
    — the nursery becomes `mailbox`'s — and build its parts. `loaded` is called in the main loop once a
    load is done. Cancellation: unwinding `stack` closes what this opened."""
    settings = wiring.settings
    plan = wiring.faults.transfer_plan(wiring.name)
    endpoints = await pools.open(stack, wiring.fabric, settings, plan, sender)
    mailbox.nursery = await stack.enter_async_context(trio.open_nursery())
    target = CopyTarget(
        name=wiring.name,
        log=wiring.log,
        endpoint=endpoints.weights,
        host=wiring.host,
        fabric=wiring.fabric,
        faults=wiring.faults,
        directory=wiring.directory,
        timeout=settings.weights_transfer.progress_timeout,
        changes=wiring.changes,
    )
    loader = Loader(
        mailbox,
        compute=compute,
        weights=weights,
        host=wiring.host,
        settings=settings,
        kv=pools.kv if isinstance(pools, LanguagePools) else None,
        target=target,
        loaded=loaded,
        changed=wiring.changes.notify,
    )
    roles: Roles
    if isinstance(pools, EncodePools):
        assert isinstance(endpoints, EncodeEndpoints)
        roles = EncodeRoles(mailbox, endpoints=endpoints, settings=settings, compute=compute)
    else:
        assert isinstance(endpoints, LanguageEndpoints)
        roles = LanguageRoles(
            mailbox,
            endpoints=endpoints,
            kv=pools.kv,
            config=wiring.host.config,
            settings=settings,
            compute=compute,
            loader=loader,
            fabric=wiring.fabric,
            faults=wiring.faults,
            requests=wiring.requests,
            directory=wiring.directory,
            returned=wiring.returned,
            changes=wiring.changes,
        )
    return Run(mailbox=mailbox, endpoints=endpoints, loader=loader, roles=roles)
