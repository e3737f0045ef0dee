"""The UCX worker's drain of bulk messages for closed links (`transport.ucx_worker`, issue 7), on real
UCX workers over `UCX_TLS=sm,tcp` (the `ucx_env` fixture); real time, as the progress task waits on a
file descriptor."""

from __future__ import annotations

import pytest
import trio

from tests.transport.harness import two_workers
from transport.ucx_worker import BULK, tag

pytestmark = pytest.mark.usefixtures("ucx_env")


async def test_bulk_messages_for_a_closed_link_are_drained_so_even_a_rendezvous_send_completes() -> None:
    async with two_workers() as (sender, to_receiver, receiver, to_sender):
        number = receiver.register(lambda _arrival: None)
        receiver.unregister(
            number
        )  # the link closed, as `UcxLink.close` closes it; its peer has not heard yet
        receiver.disconnect(to_sender)
        sends = [sender.send(to_receiver, tag(number, BULK), bytes(size)) for size in (64, 1 << 20)]
        with trio.fail_after(5):  # a rendezvous send completes only once the receiver takes the message
            await sender.wait(sends)
        lib = receiver._lib
        probe = receiver._worker.tag_probe(lib.UCXXTag(tag(number, BULK)), lib.UCXXTagMaskFull, False)
        assert not probe.matched


async def test_bulk_messages_for_a_live_link_wait_for_its_receives() -> None:
    async with two_workers() as (sender, to_receiver, receiver, to_sender):
        number = receiver.register(lambda _arrival: None)
        send = sender.send(to_receiver, tag(number, BULK), bytes(range(256)) * 4096)
        await trio.sleep(0.3)  # several drain intervals
        assert not send.completed
        landed = bytearray(1 << 20)
        with trio.fail_after(5):
            await receiver.wait([receiver.receive(to_sender, tag(number, BULK), landed)])
            await sender.wait([send])
        assert landed == bytes(range(256)) * 4096
