"""Closing UCX links: the goodbyes an endpoint cancelled from outside still says, and a link
cancelled while being accepted — on CPU over `UCX_TLS=sm,tcp` (the `ucx_env` fixture), real time.
"""

from __future__ import annotations

import re

import pytest
import trio

import transport.links.ucx.link
from tests.transport.harness import embedding_layout, random_storage, shuffled_pool
from tests.waiting import deadline, wait_until
from transport.endpoint import open_endpoint
from transport.errors import LinkBroken

pytestmark = pytest.mark.usefixtures("ucx_env")

LAYOUT = embedding_layout(block_size=16)


async def _serve_until_cancelled(
    owner: trio.CancelScope, seed: int, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """A sending endpoint listening over ucx, its address reported, until `owner` is cancelled."""
    with owner:
        async with open_endpoint(
            "sender", random_storage(LAYOUT, 4, seed), shuffled_pool(4, 16, seed)
        ) as sender:
            task_status.started(await sender.listen_on("ucx"))
            await trio.sleep_forever()


async def test_an_endpoint_cancelled_from_outside_still_says_goodbye_on_its_ucx_links() -> None:
    """Its owner's scope cancelled (a node shutting down), the sending endpoint's links close before its
    worker cuts the endpoints: the receiver hears why at once, not a heartbeat deadline later. Trio runs
    the cancelled tasks in a random order, so this tries several times."""
    for attempt in range(6):
        async with (
            open_endpoint("receiver", random_storage(LAYOUT, 4, 9), shuffled_pool(4, 16, 9)) as receiver,
            trio.open_nursery() as nursery,
        ):
            owner = trio.CancelScope()
            link = await receiver.connect(await nursery.start(_serve_until_cancelled, owner, attempt))
            owner.cancel()
            with deadline("the receiver hearing its link closed", 1):  # the link deadline is 5 s
                await link.closed.wait()
            assert re.fullmatch(
                r"link receiver ⇄ sender \(ucx-\d+\): the peer closed it \(.+\)", str(link.error)
            )


async def test_a_link_whose_accept_is_cancelled_is_closed_and_its_dialer_told_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sending endpoint stops while a link is being accepted (the accept body is stuck, as on a full
    UCX queue): that link, which no owner knows yet, closes — saying goodbye, so the dialing side fails
    at once, naming why — instead of staying registered for its worker's teardown to wait on."""
    accepting: list[transport.links.ucx.link.UcxLink] = []
    post_control = transport.links.ucx.link.UcxLink.post_control

    async def stuck_accept(link: transport.links.ucx.link.UcxLink, body: bytes) -> None:
        if link.role == "sender":
            accepting.append(link)
            await trio.sleep_forever()
        await post_control(link, body)

    monkeypatch.setattr(transport.links.ucx.link.UcxLink, "post_control", stuck_accept)
    with deadline("the cancelled accept closing its link, the dialer told", 3):  # handshake deadline 5 s
        async with (
            open_endpoint("receiver", random_storage(LAYOUT, 4, 9), shuffled_pool(4, 16, 9)) as receiver,
            trio.open_nursery() as nursery,
        ):
            owner = trio.CancelScope()
            address = await nursery.start(_serve_until_cancelled, owner, 0)
            refused: list[LinkBroken] = []

            async def connect() -> None:
                with pytest.raises(LinkBroken) as caught:
                    await receiver.connect(address)
                refused.append(caught.value)

            nursery.start_soon(connect)
            await wait_until(lambda: accepting, "the sending endpoint accepting the link")
            owner.cancel()
    (link,) = accepting
    assert str(link.error) == "accepting given up: cancelled"
    (error,) = refused
    assert re.fullmatch(
        r"ucx://[0-9a-f]{18}… closed the link as it accepted it: accepting given up: cancelled", str(error)
    )
