"""`transport.bulk.gpu_copy` where it runs without a GPU: the fence's wait (`copies_done`) on a real copy that
completes in another thread, and the copy's fallback through a temporary. The kernel itself needs a
GPU (`test_gpu_pools.py`)."""

from __future__ import annotations

import threading

import pytest
import torch
import trio

from transport.bulk import gpu_copy


class ThreadCopy:
    """A real asynchronous copy with a CUDA event's two calls: `source` copied into `target` by a
    thread that starts when `release` is set (so a test decides when the copy can finish)."""

    def __init__(self, source: torch.Tensor, target: torch.Tensor) -> None:
        self.release = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(source, target), daemon=True)
        self._thread.start()

    def _run(self, source: torch.Tensor, target: torch.Tensor) -> None:
        self.release.wait()
        target.copy_(source)
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()


def tensors() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(1 << 16, dtype=torch.int64), torch.zeros(1 << 16, dtype=torch.int64)


async def test_copies_done_returns_after_the_copy_landed_when_polling_sees_it() -> None:
    source, target = tensors()
    copy = ThreadCopy(source, target)
    copy.release.set()
    await gpu_copy.copies_done(copy, nbytes=10**12)  # a long poll budget: polling finds it done
    assert torch.equal(target, source)


async def test_copies_done_waits_in_a_thread_past_the_poll_budget() -> None:
    source, target = tensors()
    copy = ThreadCopy(source, target)

    async def release_later() -> None:
        await trio.sleep(2 * gpu_copy.POLL_SLACK_SECONDS)  # past the budget of a 0-byte copy
        copy.release.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(release_later)
        await gpu_copy.copies_done(copy, nbytes=0)
        assert copy.query()
    assert torch.equal(target, source)


@pytest.mark.parametrize("nbytes", [0, 10**12], ids=["in-the-thread", "while-polling"])
async def test_a_cancelled_wait_still_waits_for_the_copy_then_raises(nbytes: int) -> None:
    """The fence is never abandoned: cancelled while the copy runs, `copies_done` returns only after
    the copy finished, by raising `Cancelled`."""
    source, target = tensors()
    copy = ThreadCopy(source, target)
    landed_when_cancelled: list[bool] = []
    scope = trio.CancelScope()

    async def cancel_then_release() -> None:  # outside the cancelled scope
        await trio.sleep(0.01)
        scope.cancel()
        await trio.sleep(0.01)
        copy.release.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(cancel_then_release)
        with scope:
            try:
                await gpu_copy.copies_done(copy, nbytes=nbytes)
            except trio.Cancelled:
                landed_when_cancelled.append(bool(torch.equal(target, source)))
                raise
    assert scope.cancelled_caught
    assert landed_when_cancelled == [True]


def test_the_copy_goes_through_a_temporary_without_a_gpu() -> None:
    """On CPU tensors there is no kernel (`prepare` says so) and `copy_groups` gathers and scatters
    whole groups, byte for byte."""
    assert gpu_copy.prepare(torch.device("cpu")) is None
    source = torch.randint(0, 256, (8 * 4, 6), dtype=torch.uint8)
    target = torch.zeros_like(source)
    gpu_copy.copy_groups(source, target, 4, torch.tensor([5, 0, 2]), torch.tensor([1, 7, 3]))
    expected = torch.zeros_like(target)
    for src, dst in ((5, 1), (0, 7), (2, 3)):
        expected[dst * 4 : (dst + 1) * 4] = source[src * 4 : (src + 1) * 4]
    assert torch.equal(target, expected)
