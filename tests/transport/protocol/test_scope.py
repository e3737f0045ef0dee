"""`open_task_scope`: the owner sees its own exception, not a group around it."""

from __future__ import annotations

import pytest
import trio

from transport.protocol.scope import open_task_scope


async def test_a_lone_exception_comes_out_as_itself() -> None:
    with pytest.raises(ValueError, match=r"^owner$"):
        async with open_task_scope() as nursery:
            nursery.start_soon(trio.sleep_forever)
            raise ValueError("owner")


async def test_a_lone_exception_beside_an_outer_cancellation_comes_out_as_itself() -> None:
    # The helper's Cancelled belongs to the outer scope, so the nursery cannot absorb it; dropping it is
    # safe: the outer scope stays cancelled and its next checkpoint raises Cancelled again.
    with trio.CancelScope() as outer:
        with pytest.raises(ValueError, match=r"^owner$"):
            async with open_task_scope() as nursery:
                nursery.start_soon(trio.sleep_forever)
                await trio.sleep(0)
                outer.cancel()
                raise ValueError("owner")
        await trio.sleep(0)
        pytest.fail("the outer scope's cancellation was lost")
    assert outer.cancelled_caught


async def test_only_cancellations_stay_cancellations() -> None:
    with trio.CancelScope() as outer:
        async with open_task_scope() as nursery:
            nursery.start_soon(trio.sleep_forever)
            outer.cancel()
            await trio.sleep_forever()
    assert outer.cancelled_caught


async def test_two_errors_stay_a_group() -> None:
    async def fail(message: str) -> None:
        raise KeyError(message)

    with pytest.RaisesGroup(KeyError, KeyError):
        async with open_task_scope() as nursery:
            nursery.start_soon(fail, "a")
            nursery.start_soon(fail, "b")
