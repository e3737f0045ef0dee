"""A replica's place in the state machine (architecture §6): its state, its locks, its last error.

`Lifecycle` is the one writer of the three. A commanded move is checked first (`check_command`: the
state table, then whether the replica's pools can serve the role the target leads to) — a refused one
changes nothing — and entered after; an automatic one (`replicas.actor.moves`) is asserted against the
table. Entering a state emits `ReplicaStateChanged` and then calls `entered(previous, target)`, given
by the actor: what the new state starts (a load, decode graphs, dropping the weights) and what the
roles do about it. It also records whether the load a `Loading*` or `NewPrefill` state waits for has
landed (`landed`), which the automatic moves read; entering any state forgets it.

Nothing here waits: every method runs in the actor's main loop (or, for `fail`, in the supervisor once
the run has ended).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import final

import trio

from messages.control import LockReason
from messages.log.events import ReplicaLocked, ReplicaStateChanged, ReplicaUnlocked
from replicas.inbox import CommandRefused
from replicas.ports import EventSink
from replicas.states import (
    STATE_ROLE,
    InvalidTransition,
    ReplicaState,
    Role,
    check_automatic,
    check_command,
)

S = ReplicaState


@final
class Lifecycle:
    """See the module docstring. `name` is the replica's; `changed` notifies the node-wide change
    signal (state, lock)."""

    def __init__(
        self,
        name: str,
        log: EventSink,
        changed: Callable[[], None],
        entered: Callable[[ReplicaState, ReplicaState], None],
    ) -> None:
        self._name = name
        self._log = log
        self._changed = changed
        self._entered = entered
        self._state = S.INACTIVE
        self._since = trio.current_time()
        self._locks: set[LockReason] = set()
        self._landed = False
        self.last_error: str | None = None

    # ------------------------------------------------------------------ what others may read
    @property
    def state(self) -> ReplicaState:
        return self._state

    @property
    def since(self) -> float:
        """When it entered `state` (Trio's clock)."""
        return self._since

    @property
    def lock_reasons(self) -> frozenset[LockReason]:
        return frozenset(self._locks)

    @property
    def locked(self) -> bool:
        """Non-decode replicas are always locked; a decode replica while any lock reason holds."""
        return self._state is not S.DECODE or bool(self._locks)

    @property
    def weights_landed(self) -> bool:
        """The load the current state waits for is done (see the module docstring)."""
        return self._landed

    # ------------------------------------------------------------------ moves
    def check_command(self, target: ReplicaState, missing: str | None, role: Role) -> None:
        """Raise `CommandRefused` (`invalid_transition`) unless a commanded move to `target` may happen
        now; `missing`: why the replica's pools cannot serve `target`'s role (None: they can); `role`:
        the role the replica was configured for."""
        previous = self._state
        try:
            check_command(self._name, previous, target)
        except InvalidTransition as exc:
            raise CommandRefused("invalid_transition", str(exc)) from None
        if missing is not None:
            raise CommandRefused(
                "invalid_transition",
                f"{self._name}: cannot move from {previous.value} to {target.value}: {missing} "
                f"(it was configured as {'an' if role == 'encode' else 'a'} {role} replica)",
            )

    def commanded(self, target: ReplicaState, reason: str) -> ReplicaState:
        """Enter `target` on a command already checked (`check_command`); returns the state it left."""
        return self._enter(target, "command", reason)

    def move(self, target: ReplicaState, reason: str) -> ReplicaState:
        """An automatic move (the actor applies `replicas.actor.moves`); returns the state it left."""
        check_automatic(self._name, self._state, target)
        return self._enter(target, "automatic", reason)

    def landed(self) -> None:
        """The load the current state waits for is done: its automatic move may happen."""
        self._landed = True

    def _enter(self, target: ReplicaState, trigger: str, reason: str) -> ReplicaState:
        previous, self._state = self._state, target
        self._since = trio.current_time()
        self._landed = False
        self._log.emit(
            ReplicaStateChanged(
                from_state=previous.value,
                to_state=target.value,
                trigger="command" if trigger == "command" else "automatic",
                reason=reason,
            )
        )
        self._entered(previous, target)
        return previous

    def fail(self, error: BaseException) -> None:
        """After a crash (the run has ended): record `error` and go `Inactive`, entering nothing."""
        self.last_error = f"{type(error).__name__}: {error}"
        if self._state is not S.INACTIVE:
            previous, self._state = self._state, S.INACTIVE
            self._since = trio.current_time()
            self._landed = False
            self._log.emit(
                ReplicaStateChanged(
                    from_state=previous.value,
                    to_state=S.INACTIVE.value,
                    trigger="automatic",
                    reason="replica failed",
                )
            )
        self._changed()

    # ------------------------------------------------------------------ locks
    def lock(self, reason: LockReason, used_blocks: int, total_blocks: int) -> list[LockReason]:
        if reason not in self._locks:
            self._locks.add(reason)
            self._log.emit(ReplicaLocked(reason=reason, used_blocks=used_blocks, total_blocks=total_blocks))
        return sorted(self._locks)

    def unlock(self, reason: LockReason) -> list[LockReason]:
        if reason in self._locks:
            self._locks.discard(reason)
            self._log.emit(ReplicaUnlocked(reason=reason, still_locked=bool(self._locks)))
            self._changed()
        return sorted(self._locks)

    def check_reservable(self) -> None:
        """Raise `CommandRefused` (`overloaded`) unless the replica takes a KV migration now: in
        `Decode`, unlocked."""
        if self._state is not S.DECODE:
            raise CommandRefused("overloaded", f"{self._name} is {self._state.value}, not Decode")
        if self._locks:
            raise CommandRefused("overloaded", f"{self._name} is locked ({', '.join(sorted(self._locks))})")


def missing_pool(
    configured: Role, target: ReplicaState, *, kv: bool, landing: bool, vision: bool
) -> str | None:
    """Why a replica configured as `configured` cannot serve the role `target` leads to (None: it can).
    Pure.

    A role change keeps the pools the replica was built with: prefill needs a KV cache (`kv`) and, for
    a model with a vision encoder (`vision`), an embedding landing pool (`landing`); decode a KV cache;
    encode an encoder's embedding pool. (Image requests would otherwise wait for a prefill replica that
    can take them.)"""
    role = STATE_ROLE.get(target)
    if role == "encode" and configured != "encode":
        return "it has no encoder output pool to serve encode"
    if role in ("prefill", "decode") and not kv:
        return f"it has no KV cache to serve {role}"
    if role == "prefill" and vision and not landing:
        return "it has no embedding landing pool for the model's images, so it cannot serve prefill"
    return None
