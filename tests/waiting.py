"""Waiting in a test: every wait has a deadline, and a wait that runs out names what it waited for.

A condition a test waits for is signalled where the code under test offers a signal (a `trio.Event`, a
channel, a process exiting) — wrap that wait in `deadline` — and polled through `wait_until` where it
does not (a pool's counters, a log file, a status reply). Both fail with an `AssertionError` that reads
"<what> did not happen within <seconds> s", so a test that hangs on a loaded machine says where:

    await wait_until(lambda: pool.quarantined_blocks == 0, "every quarantined block released", 10)
    with deadline("the handler to start request q", 10):
        await started.wait()
    wait_until_blocking(lambda: child.poll() is not None, "the child process to exit", 30)  # sync tests

Nothing else in the tests may poll: `tests/test_waits.py` fails on a `while` loop that sleeps or
checkpoints outside this module. pytest-timeout (`pyproject.toml`) stays only as a last net for a wait
nobody bounded, and it names no condition.

Clocks. `wait_until` and `deadline` run on the current trio run's clock (`trio.current_time`,
`trio.sleep`, `trio.move_on_after`), so under `autojump_clock` (a `trio.testing.MockClock`) their
seconds and the poll interval are virtual: a wait for something trio's own tasks do on that clock
behaves as in real time, only faster (the clock jumps over the idle stretches). A wait for work
outside trio's view — a thread, another process, a socket's peer — must not run on a mock clock: the
clock jumps whenever every task is blocked, so its deadline can pass in no real time at all. Such a
test uses the real clock (no `autojump_clock`), as every test with a child process here does.
`wait_until_blocking` is for code outside any trio run and always uses real time (`time.monotonic`).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import trio

T = TypeVar("T")

# The deadline of a wait that names none: generous for a loaded 2-core CI machine, yet well inside
# pytest-timeout's last net (`timeout` in pyproject.toml).
WAIT_SECONDS = 30.0
# How often `wait_until` looks: often enough that a test does not idle, rarely enough to leave the CPU
# to the tasks it waits for.
POLL_INTERVAL = 0.01


def _message(what: str, seconds: float, detail: Callable[[], object] | None) -> str:
    message = f"{what} did not happen within {seconds:g} s"
    if detail is not None:
        message += f"; {detail()}"
    return message


async def wait_until(
    condition: Callable[[], T | Awaitable[T]],
    what: str,
    seconds: float = WAIT_SECONDS,
    *,
    interval: float = POLL_INTERVAL,
    detail: Callable[[], object] | None = None,
) -> T:
    """Call `condition()` (a plain function, or an async one) until it returns something true, and
    return that; look again every `interval` seconds. Fail with "`what` did not happen within
    `seconds` s" (followed by `detail()`, when given: the state last seen) once `seconds` have passed
    on the current trio clock — see the module docstring on mock clocks."""
    with trio.move_on_after(seconds):
        while True:
            result = condition()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return result  # type: ignore[return-value]  # an awaitable's result is a T
            await trio.sleep(interval)
    raise AssertionError(_message(what, seconds, detail))


@contextmanager
def deadline(
    what: str, seconds: float = WAIT_SECONDS, *, detail: Callable[[], object] | None = None
) -> Iterator[trio.CancelScope]:
    """A block that must finish within `seconds` on the current trio clock: otherwise it is cancelled
    and fails with "`what` did not happen within `seconds` s" (and `detail()`, when given). For a
    signalled wait:

        with deadline("the sender's first round", 10):
            await first_round.wait()

    Unlike `trio.fail_after`, whose `TooSlowError` names nothing, the failure says what was awaited; a
    deadline of an inner scope that runs out first is that scope's failure, not this one's."""
    with trio.move_on_after(seconds) as scope:
        yield scope
    if scope.cancelled_caught:
        raise AssertionError(_message(what, seconds, detail))


def wait_until_blocking(
    condition: Callable[[], T],
    what: str,
    seconds: float = WAIT_SECONDS,
    *,
    interval: float = POLL_INTERVAL,
    detail: Callable[[], object] | None = None,
) -> T:
    """`wait_until` for code outside a trio run (a sync test, a fixture, a thread): blocks this thread,
    on real time."""
    give_up = time.monotonic() + seconds
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() >= give_up:
            raise AssertionError(_message(what, seconds, detail))
        time.sleep(interval)
