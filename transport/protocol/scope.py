"""A nursery that re-raises a lone exception as itself instead of inside an `ExceptionGroup`.

Transfer sessions run helper tasks that never raise (they record a failure and cancel the scope); the
only exception that can leave the body is the owner's (a consumer error, an outer cancellation), and the
owner should see that exception, not a group around it. When an outer scope is cancelled at the moment
the body fails, the helpers' `Cancelled` travel beside the owner's exception; they are dropped, which is
safe: Trio's cancellation is level-triggered, so the cancelled scope's next checkpoint raises it again.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio


def describe_exit(exc: BaseException) -> str:
    """How an owner's exception reads in an abort reason: "cancelled" for (groups of) cancellations."""
    if isinstance(exc, trio.Cancelled):
        return "cancelled"
    if isinstance(exc, BaseExceptionGroup):
        leaves = exc.split(trio.Cancelled)[1]
        return (
            "cancelled"
            if leaves is None
            else repr(leaves.exceptions[0] if len(leaves.exceptions) == 1 else leaves)
        )
    return repr(exc)


@asynccontextmanager
async def open_task_scope() -> AsyncIterator[trio.Nursery]:
    try:
        async with trio.open_nursery() as nursery:
            yield nursery
    except BaseExceptionGroup as group:
        _cancelled, others = group.split(trio.Cancelled)
        if others is None:
            raise  # only cancellations: the cancelled scope catches them as a group
        if len(others.exceptions) == 1 and not isinstance(others.exceptions[0], BaseExceptionGroup):
            raise others.exceptions[0] from group
        raise
