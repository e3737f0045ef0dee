"""The replica actor (architecture §6): one Trio task that owns all of a replica's state.

Everything that reaches a replica goes through its *inbox*: commands (`messages.commands`), the
transfer protocol's sender-bound messages, and the completions of its own compute. The main loop drains
the inbox — commands first — then lets the current state's behaviour start at most one compute (a
prefill batch, a decode step, an encode job) in a worker thread, and sleeps until the next item. It never
blocks on compute, so control is never stuck behind work; and it is the only writer of the state:
helpers (the migrator, transfers, loading) post their outcomes to the inbox.

Cancellation: cancelling `run` cancels the replica's nursery — transfers abort (their blocks return to
the pools through the transport's shielded cleanup), a compute in a worker thread finishes (threads are
never abandoned) and its result is dropped. Any other exception ends `run`; the supervisor then fails
the replica's requests and frees its blocks.
"""

from __future__ import annotations

import math
from contextlib import AsyncExitStack
from typing import Any, assert_never, final

import trio

from messages.commands import (
    DropKVHalf,
    Flush,
    Lock,
    Relay,
    ReplicaCommand,
    ReserveKV,
    SendKVHalf,
    SendWeights,
    Transition,
    Unlock,
)
from messages.control import LockReason
from messages.faults import FailReplica
from messages.log.events import FaultInjected, ReplicaLocked, ReplicaStateChanged, ReplicaUnlocked
from messages.transfer import Abort, Grant, RequestMoreCache, StatusUpdate
from replicas.inbox import CommandRefused, Completed, Envelope, InboxItem, InjectedFault
from replicas.loading.peer_send import send_weights
from replicas.pools import ReplicaPools
from replicas.request import ServingRequest
from replicas.roles import RoleWork
from replicas.services import ReplicaServices
from replicas.states import (
    STATE_ROLE,
    InvalidTransition,
    ReplicaState,
    Role,
    TransitionNotSupported,
    check_automatic,
    check_command,
    parse_state,
)
from transport.endpoint import SenderDelivery

S = ReplicaState


@final
class Replica:
    """See the module docstring. `name` is `{role}-{index}`; `role` is the role it was configured for."""

    def __init__(self, name: str, role: Role, services: ReplicaServices) -> None:
        self.name = name
        self.role = role
        self.services = services
        self.log = services.log.bind(replica=name)
        self.state = S.INACTIVE
        self.state_since = trio.current_time()  # when it entered `state` (Trio's clock)
        self.lock_reasons: set[LockReason] = set()
        self.last_error: str | None = None
        self.pools = ReplicaPools(name, role, services)
        self._inbox_send, self._inbox = trio.open_memory_channel[InboxItem](math.inf)
        self._sender_send, self._sender_receive = trio.open_memory_channel[SenderDelivery](math.inf)
        self._unhandled: list[Envelope] = []
        self.nursery: trio.Nursery | None = None
        self.work = RoleWork(self)
        self.steps = 0
        self._fail_after = next(
            (f.after_steps for f in services.faults if isinstance(f, FailReplica) and f.replica == name), None
        )

    # ------------------------------------------------------------------ what others may ask
    @property
    def locked(self) -> bool:
        """Non-decode replicas are always locked; a decode replica while any lock reason holds."""
        return self.state is not S.DECODE or bool(self.lock_reasons)

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
                f"(state {self.state.value}; last error: {self.last_error})",
            )
        if envelope.error is not None:
            raise envelope.error
        return envelope.result

    def tell(self, command: ReplicaCommand) -> None:
        """Send `command` without waiting for its outcome."""
        self.post(Envelope(command))

    def submit(self, request: ServingRequest) -> bool:
        """Queue `request` for this replica's role; False when it takes no new work now — also while its
        task is not running: between a failure and the supervisor marking it `Inactive` its state still
        says it serves, and the router's request then failed with an internal error."""
        if self.nursery is None:
            return False
        accepted = self.work.submit(request)
        if accepted:
            self.post()
        return accepted

    # ------------------------------------------------------------------ the task
    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled (see the module docstring)."""
        async with AsyncExitStack() as stack:
            await self.pools.open_endpoints(stack, self._sender_send)
            self.nursery = nursery = await stack.enter_async_context(trio.open_nursery())
            nursery.start_soon(self._forward_sender_messages)
            self.work.start(nursery)
            task_status.started()
            try:
                await self._main_loop()
            finally:
                self.nursery = None
                nursery.cancel_scope.cancel()

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
            self._check_fault()
            self.work.advance()

    async def _forward_sender_messages(self) -> None:
        async for delivery in self._sender_receive:
            self.post(Envelope(delivery.message, link=delivery.link))

    def _check_fault(self) -> None:
        self.steps += 1
        if self._fail_after is not None and self.steps > self._fail_after:
            self._fail_after = None
            self.log.emit(FaultInjected(fault="fail_replica", detail=f"after {self.steps - 1} loop steps"))
            raise InjectedFault(f"{self.name}: injected failure (fail_replica fault hook)")

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
        match command:
            case Transition(to=to):
                self.work.weights.commanded(to, command.source)  # where a Loading* state loads from
                target = parse_state(to)
                if target is S.OLD_PREFILL and self.state is S.OLD_PREFILL and command.paired_with:
                    self.work.paired(target, command.paired_with)  # one more partner (shared)
                    return self.state
                previous = self._commanded(target, command.origin)
                self.work.paired(target, command.paired_with)
                return previous
            case Lock(reason=reason):
                return self._lock(reason)
            case Unlock(reason=reason):
                return self._unlock(reason)
            case Flush():
                return self.work.flush()
            case Relay():
                if self.state not in (S.NEW_PREFILL, S.REFRACTORY_PREFILL):
                    raise CommandRefused("not_found", f"{self.name} is {self.state.value}: no batch to relay")
                return self.work.new_prefill.offer(command)
            case SendKVHalf():
                return self.work.new_prefill.send_half(command)
            case DropKVHalf():
                return self.work.new_prefill.drop_half(command.request_id)
            case ReserveKV():
                return self.work.reserve_kv(command)
            case SendWeights():
                return send_weights(self, command)
            case Grant() | RequestMoreCache() | Abort() | StatusUpdate():
                assert envelope.link is not None
                self.pools.deliver(SenderDelivery(envelope.link, command))
                return None
            case _:
                assert_never(command)

    def _commanded(self, target: ReplicaState, origin: str) -> ReplicaState:
        previous = self.state
        try:
            check_command(self.name, previous, target)
        except TransitionNotSupported as exc:
            raise CommandRefused("not_supported", str(exc)) from None
        except InvalidTransition as exc:
            raise CommandRefused("invalid_transition", str(exc)) from None
        missing = self._missing_pool(target)
        if missing is not None:
            raise CommandRefused(
                "invalid_transition",
                f"{self.name}: cannot move from {previous.value} to {target.value}: {missing} "
                f"(it was configured as {'an' if self.role == 'encode' else 'a'} {self.role} replica)",
            )
        self._enter(target, "command", f"{origin} command")
        return previous

    def _missing_pool(self, target: ReplicaState) -> str | None:
        """Why this replica's pools cannot serve the role `target` leads to (None: they can).

        A role change keeps the pools the replica was built with: prefill needs a KV cache and, for a
        model with a vision encoder, an embedding landing pool; decode a KV cache; encode an encoder's
        embedding pool. (Image requests would otherwise wait for a prefill replica that can take them.)"""
        role = STATE_ROLE.get(target)
        pools = self.pools
        if role == "encode" and self.role != "encode":
            return "it has no encoder output pool to serve encode"
        if role in ("prefill", "decode") and pools.kv is None:
            return f"it has no KV cache to serve {role}"
        vision = self.services.host.config.image_token_id is not None
        if role == "prefill" and vision and pools.emb_pool is None:
            return "it has no embedding landing pool for the model's images, so it cannot serve prefill"
        return None

    def move(self, target: ReplicaState, reason: str) -> None:
        """An automatic move (called by the role behaviour from the main loop)."""
        check_automatic(self.name, self.state, target)
        self._enter(target, "automatic", reason)

    def _enter(self, target: ReplicaState, trigger: str, reason: str) -> None:
        previous, self.state = self.state, target
        self.state_since = trio.current_time()
        self.log.emit(
            ReplicaStateChanged(
                from_state=previous.value,
                to_state=target.value,
                trigger="command" if trigger == "command" else "automatic",
                reason=reason,
            )
        )
        self.work.entered(previous, target)
        self.services.readiness_changed()
        self.post()

    def force_inactive(self, error: BaseException) -> None:
        """After a crash (the supervisor calls this once `run` has ended): record and go `Inactive`."""
        self.last_error = f"{type(error).__name__}: {error}"
        if self.state is not S.INACTIVE:
            self._enter_failed()
        self.services.readiness_changed()

    def _enter_failed(self) -> None:
        previous, self.state = self.state, S.INACTIVE
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
        if reason not in self.lock_reasons:
            self.lock_reasons.add(reason)
            used, total = self.pools.kv_usage()
            self.log.emit(ReplicaLocked(reason=reason, used_blocks=used, total_blocks=total))
        return sorted(self.lock_reasons)

    def _unlock(self, reason: LockReason) -> list[LockReason]:
        if reason in self.lock_reasons:
            self.lock_reasons.discard(reason)
            self.log.emit(ReplicaUnlocked(reason=reason, still_locked=bool(self.lock_reasons)))
            self.services.readiness_changed()
        return sorted(self.lock_reasons)

    def reset(self) -> None:
        """Fresh inbox and role state after a failure (the supervisor restarts `run` next).

        Commands the failed run never handled — posted while it unwound, or behind the one that failed it —
        are refused with `replica_failed`, so whoever waits on them hears of the failure at once."""
        unhandled, self._unhandled = self._unhandled, []
        while True:
            try:
                item = self._inbox.receive_nowait()
            except trio.WouldBlock:
                break
            if isinstance(item, Envelope):
                unhandled.append(item)
        for envelope in unhandled:
            envelope.error = CommandRefused(
                "replica_failed",
                f"{self.name} failed before it handled the {type(envelope.command).__name__} command "
                f"({self.last_error or 'its task ended'})",
            )
            envelope.done.set()
        self._inbox_send, self._inbox = trio.open_memory_channel[InboxItem](math.inf)
        self._sender_send, self._sender_receive = trio.open_memory_channel[SenderDelivery](math.inf)
        self.work = RoleWork(self)
