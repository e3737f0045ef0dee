"""A node's `{"listening": ...}` stdout line, read in whatever pieces it comes (`engine.control.listening`)."""

from __future__ import annotations

import trio
import trio.testing

from engine.control.listening import listening_address
from tests.waiting import deadline


async def test_the_listening_line_after_other_output_in_any_pieces() -> None:
    send, receive = trio.testing.memory_stream_one_way_pair()
    output = b'warming up\n{"other": 1}\nnot json {\n{"listening": "127.0.0.1:7341", "http": null}\n'
    with deadline("the listening line read"):
        async with trio.open_nursery() as nursery:

            async def write() -> None:
                for index in range(0, len(output), 7):
                    await send.send_all(output[index : index + 7])

            nursery.start_soon(write)
            assert await listening_address(receive) == "127.0.0.1:7341"


async def test_a_stream_that_ends_first_gives_none() -> None:
    send, receive = trio.testing.memory_stream_one_way_pair()
    await send.send_all(b'{"starting": true}\n{"listening"')
    await send.aclose()
    with deadline("the end of the stream seen"):
        assert await listening_address(receive) is None
