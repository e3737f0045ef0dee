"""The replica supervisor (architecture §6): a replica task that raises does not take the node down.

`supervise` runs the replica; when its task raises, every request the replica held gets
`replica_failed`, its blocks go back to their pools (its transfer endpoints are closed by then, so no
write can still land), it ends `Inactive` with `last_error` shown in `status`, and it is started afresh,
idle, so the `transition` op can bring it back. Cancellation (node shutdown) propagates untouched.

A replica that cannot even start — its first run fails before it serves, say because its transfer
endpoint cannot open (UCX finding no usable transport) — raises `ReplicaStartFailed` to whoever started
it: the node does not come up half-configured, and a scale-up gets an error. A restart that fails that
early again waits before the next (`RESTART_BACKOFF_FIRST`, doubling up to `RESTART_BACKOFF_MAX`), so a
dependency that broke costs a log line per wait instead of a hot loop.
"""

from __future__ import annotations

from typing import Final, final

import trio

from messages.log.events import ReplicaFailed
from replicas.actor.replica import Replica

RESTART_BACKOFF_FIRST: Final = 0.1
RESTART_BACKOFF_MAX: Final = 30.0


@final
class ReplicaStartFailed(Exception):
    """A new replica's first run failed before it could serve (see the module docstring)."""


@final
class _StartWatch:
    """The `task_status` a run gets: remembers whether the run reached `started`, passing it on to the
    supervisor's own starter on the first run."""

    def __init__(self, outer: trio.TaskStatus[None] | None) -> None:
        self.outer, self.called = outer, False

    def started(self, value: None = None) -> None:
        self.called = True
        if self.outer is not None:
            self.outer.started(value)


async def supervise(replica: Replica, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Run `replica` until cancelled, recovering from its failures (see the module docstring). Raises
    `ReplicaStartFailed`, before `task_status.started`, when the first run fails before serving."""
    first, backoff = True, RESTART_BACKOFF_FIRST
    while True:
        watch = _StartWatch(task_status if first else None)
        try:
            await replica.run(watch)
            return
        except Exception as raised:  # noqa: BLE001 - every failure of a replica is contained here and reported
            error = root_cause(raised)
            if first and not watch.called:
                raise ReplicaStartFailed(
                    f"replica {replica.name} could not start: {type(error).__name__}: {error}"
                ) from error
            first = False
            failed, freed = replica.clean_up_after(error)
            replica.log.emit(
                ReplicaFailed(error=f"{replica.last_error} ({freed} blocks returned)", failed_requests=failed)
            )
            replica.reset()
            if watch.called:
                backoff = RESTART_BACKOFF_FIRST
            else:  # the restart itself failed: whatever broke is likely still broken
                await trio.sleep(backoff)
                backoff = min(2 * backoff, RESTART_BACKOFF_MAX)


def root_cause(error: BaseException) -> BaseException:
    """What to report: nurseries wrap the exception that failed a task in groups of one on its way out."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error
