"""The replica supervisor (DESIGN §6): a replica task that raises does not take the node down.

`supervise` runs the replica; when its task raises, every request the replica held gets
`replica_failed`, its blocks go back to their pools (its transfer endpoints are closed by then, so no
write can still land), it ends `Inactive` with `last_error` shown in `status`, and it is started afresh,
idle, so the `transition` op can bring it back. Cancellation (node shutdown) propagates untouched.
"""

from __future__ import annotations

import trio

from messages.events import ReplicaFailed
from replicas.actor import Replica


async def supervise(replica: Replica, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Run `replica` until cancelled, recovering from its failures (see the module docstring)."""
    started = False
    while True:
        try:
            if started:
                await replica.run()
            else:
                await replica.run(task_status)
            return
        except Exception as raised:  # noqa: BLE001 - every failure of a replica is contained here and reported
            started = True
            error = root_cause(raised)
            failed = fail_held_requests(replica, error)
            freed = replica.pools.free_everything()
            replica.work.release_weights()
            replica.force_inactive(error)
            replica.log.emit(
                ReplicaFailed(error=f"{replica.last_error} ({freed} blocks returned)", failed_requests=failed)
            )
            replica.reset()


def root_cause(error: Exception) -> Exception:
    """What to report: the replica's nurseries wrap the exception that failed it in groups of one."""
    while isinstance(error, ExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


def fail_held_requests(replica: Replica, error: BaseException) -> int:
    failed = 0
    for request in list(replica.services.requests.values()):
        if request.holder == replica.name and not request.ended:
            request.fail("replica_failed", f"replica {replica.name} failed: {type(error).__name__}: {error}")
            failed += 1
    return failed
