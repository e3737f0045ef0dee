"""The fabric forgets another node's endpoints (its lease ended): a receiver still connecting to one of
them stops at once with a `LinkError` that says why, rather than waiting on a host that was cut off."""

from __future__ import annotations

import functools

import pytest
import trio

from replicas.fabric import Fabric
from tests.transport.harness import kv_layout, shuffled_pool
from tests.waiting import deadline
from transport.config import TransferConfig
from transport.endpoint import open_endpoint
from transport.errors import LinkError
from transport.memory.storage import PoolStorage


async def test_forgetting_a_node_stops_a_connect_to_it() -> None:
    accepted = trio.Event()
    silent: list[trio.SocketStream] = []

    async def answer_nothing(stream: trio.SocketStream) -> None:  # a host whose process hangs
        silent.append(stream)
        accepted.set()
        await trio.sleep_forever()

    layout = kv_layout()
    config = TransferConfig(handshake_timeout=600.0)  # only forgetting the node ends the connect
    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(
            functools.partial(trio.serve_tcp, answer_nothing, 0, host="127.0.0.1")
        )
        port = listener.socket.getsockname()[1]
        async with open_endpoint(
            "b/decode-0/kv", PoolStorage(layout, 8), shuffled_pool(8, 16, 1), config=config
        ) as receiver:
            fabric = Fabric("tcp", clustered=True)
            fabric.remote["a/prefill-0/kv"] = f"tcp://127.0.0.1:{port}"
            failed: list[LinkError] = []

            async def connect() -> None:
                with pytest.raises(LinkError) as error:
                    await fabric.link(receiver, "a/prefill-0/kv")
                failed.append(error.value)

            with deadline("the connect stopped", 30):
                async with trio.open_nursery() as connecting:
                    connecting.start_soon(connect)
                    await accepted.wait()
                    fabric.forget_remote("a/", "node a left the cluster")
            assert str(failed[0]).endswith("stopped: node a left the cluster"), failed
            assert "a/prefill-0/kv" not in fabric.remote
        nursery.cancel_scope.cancel()
