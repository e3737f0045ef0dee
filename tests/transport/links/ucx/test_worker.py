"""The UCX worker's drain of bulk messages for closed links (`transport.links.ucx.worker`), on real
UCX workers over `UCX_TLS=sm,tcp` (the `ucx_env` fixture); real time, as the progress task waits on a
file descriptor."""

from __future__ import annotations

from functools import partial

import pytest
import trio

from tests.transport.harness import two_workers
from tests.waiting import deadline, wait_until
from transport.links.ucx.reads import PATIENT_BYTES, Receipt
from transport.links.ucx.worker import BULK, tag

pytestmark = pytest.mark.usefixtures("ucx_env")


async def test_bulk_messages_for_a_closed_link_are_drained_so_even_a_rendezvous_send_completes() -> None:
    async with two_workers() as (sender, to_receiver, receiver, to_sender):
        number = receiver.register(lambda _arrival: None)
        receiver.unregister(
            number
        )  # the link closed, as `UcxLink.close` closes it; its peer has not heard yet
        receiver.disconnect(to_sender)
        sends = [sender.send(to_receiver, tag(number, BULK), bytes(size)) for size in (64, 1 << 20)]
        # A rendezvous send completes only once the receiver takes the message.
        with deadline("the sends to a closed link completing", 5):
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
        with deadline("the bulk message landing once received", 5):
            await receiver.wait([receiver.receive(to_sender, tag(number, BULK), landed)])
            await sender.wait([send])
        assert landed == bytes(range(256)) * 4096


async def test_a_patient_wait_rests_the_progress_loop_only_while_no_request_is_in_flight() -> None:
    """A sender waiting for a large read group's receipt does not poll (`UcxWorker.wait(patient=True)`),
    unless a UCX request of its own is still in flight; once the wait ends, polling is as before."""
    assert Receipt(1, PATIENT_BYTES).patient and not Receipt(1, PATIENT_BYTES - 1).patient
    async with two_workers() as (sender, to_receiver, receiver, to_sender):
        receipt = Receipt(1, PATIENT_BYTES)
        assert not sender._resting()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(sender.wait, [receipt], check=False, patient=True))
            await wait_until(sender._resting, "the sender's progress loop resting in its patient wait", 5)
            number = receiver.register(lambda _arrival: None)
            send = sender.send(to_receiver, tag(number, BULK), bytes(1 << 20))  # rendezvous: until received
            assert not sender._resting()
            landed = bytearray(1 << 20)
            with deadline("the rendezvous send landing", 5):
                await receiver.wait([receiver.receive(to_sender, tag(number, BULK), landed)])
                await sender.wait([send])
            assert sender._resting()
            receipt.completed = True
            sender.kick()  # as the link does once the receipt came
        assert not sender._resting()
