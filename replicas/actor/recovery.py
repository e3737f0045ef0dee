"""What is left after a replica's run failed (architecture §6, the supervisor's side).

Once the run has ended its endpoints are closed, so no transfer can still write: every request the
replica held fails with `replica_failed`, every block goes back to its pool, its weights go, it is
`Inactive` with its last error, and the other replicas of its node look again at their state (a ZigZag
partner ends its episode). The commands the run left unhandled are refused by its inbox
(`replicas.actor.intake`); the next run is built afresh (`replicas.actor.wiring`).
"""

from __future__ import annotations

from collections.abc import Callable

from replicas.actor.pools import EncodePools, LanguagePools
from replicas.actor.transitions import Lifecycle
from replicas.ports import Directory, LiveRequests


def recover(
    error: BaseException,
    *,
    name: str,
    requests: LiveRequests,
    pools: LanguagePools | EncodePools,
    release_weights: Callable[[], None],
    lifecycle: Lifecycle,
    directory: Directory,
) -> tuple[int, int]:
    """Clean up after replica `name`'s run raised `error` (see the module docstring). Returns (requests
    failed, blocks freed)."""
    failed = 0
    for request in [r for r in requests.values() if r.holder == name and not r.ended]:
        request.fail("replica_failed", f"replica {name} failed: {type(error).__name__}: {error}")
        failed += 1
    freed = pools.free_everything()
    release_weights()
    lifecycle.fail(error)
    for other in directory.local():
        other.post()
    return failed, freed
