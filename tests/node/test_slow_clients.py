"""Clients that misbehave or change their mind, on a real node (`tiny_inproc_node`: 16 queued replies,
a small queue). A client that stops reading or disconnects while streaming has its requests cancelled;
`cancel` ends a generate mid-way and the connection goes on; more live requests than `--max-queue` are
`overloaded`. After each, the node still serves correctly and every replica's blocks return.
"""

from __future__ import annotations

import uuid
from functools import partial

import pytest
import trio

from engine.client import ControlError
from messages.control_replies import TokenReply
from replicas.model import Model
from tests.node.conftest import MAX_OUTBOUND_REPLIES, MAX_QUEUE
from tests.node.harness import NodeProcess, by_name, wait_idle, wait_serving, wait_status
from tests.node.raw import raw_connection
from tests.node.workload import (
    Ask,
    Outcome,
    assert_correct,
    assert_model_tokens,
    distinct_asks,
    launch,
    names_request,
    send,
    still_serving,
)


async def test_a_client_that_stops_reading_has_its_requests_cancelled(
    tiny_inproc_node: NodeProcess, tiny: Model
) -> None:
    """16 streamed requests with long ids (~500-byte token replies) on a connection with a tiny receive
    buffer that the client does not read: once 16 replies wait, every request is cancelled; reading
    again shows the tokens, then one `cancelled` error per request, and the connection still works."""
    node = tiny_inproc_node
    tag = uuid.uuid4().hex[:8]
    request_ids = [f"slow-{tag}-{i:02d}-" + "r" * 100 for i in range(16)]
    lines = b"".join(
        b'{"op":"generate","id":"'
        + f"{i:02d}-".encode()
        + b"c" * 250
        + b'","input_ids":[1,2,3],"max_tokens":100,"ignore_eos":true,"stream":true,"request_id":"'
        + rid.encode()
        + b'"}\n'
        for i, rid in enumerate(request_ids)
    )
    async with raw_connection(node, receive_buffer=4096) as raw:
        await raw.send(lines)
        await node.wait_event("slow_client", lambda e: True)
        finals: dict[str, dict[str, object]] = {}
        tokens = 0
        while len(finals) < len(request_ids):
            reply = await raw.reply()
            if reply["type"] == "token":
                tokens += 1
                assert reply["request_id"] not in finals
            else:
                finals[reply["request_id"]] = reply
        assert set(finals) == set(request_ids)
        for reply in finals.values():
            assert (reply["type"], reply["code"], reply["message"]) == (
                "error",
                "cancelled",
                f"cancelled: the client stopped reading its replies ({MAX_OUTBOUND_REPLIES} were waiting; "
                f"the limit is --max-outbound-replies {MAX_OUTBOUND_REPLIES})",
            )
        assert tokens < len(request_ids) * 100
        status = await raw.ask(b'{"op":"status","id":"after"}\n')
        assert (status["type"], status["id"]) == ("result", "after")
    (slow,) = [e for e in node.events("slow_client")]
    assert (slow["queued_replies"], slow["cancelled_requests"]) == (MAX_OUTBOUND_REPLIES, len(request_ids))
    for rid in request_ids:  # logged when the replica drops the request, maybe after the error reply
        event = await node.wait_event("request_cancelled", partial(names_request, rid))
        assert event["reason"] == "client_too_slow"
    await still_serving(node, tiny, offset=130)


async def test_a_client_that_disconnects_while_streaming_has_its_request_cancelled(
    tiny_inproc_node: NodeProcess, tiny: Model
) -> None:
    node = tiny_inproc_node
    request_id = f"gone-{uuid.uuid4().hex[:8]}"
    async with raw_connection(node) as raw:
        await raw.send(
            b'{"op":"generate","id":"g","input_ids":[1,2,3,4],"max_tokens":2000,"ignore_eos":true,'
            b'"stream":true,"request_id":"' + request_id.encode() + b'"}\n'
        )
        assert (await raw.reply())["type"] == "token"
    event = await node.wait_event("request_cancelled", lambda e: e["request_id"] == request_id)
    assert (event["reason"], 1 <= event["output_tokens"] < 2000) == ("client_disconnected", True), event
    await still_serving(node, tiny, offset=140)


async def test_cancel_mid_generation_ends_the_generate_and_the_connection_goes_on(
    tiny_inproc_node: NodeProcess, tiny: Model
) -> None:
    node = tiny_inproc_node
    request_id = f"cancel-{uuid.uuid4().hex[:8]}"
    ask = Ask(input_ids=(11, 12, 13, 14, 15), max_tokens=2000, ignore_eos=True, stream=True)
    streamed: list[TokenReply] = []
    async with node.client() as client:
        await wait_serving(client)
        async for reply in client.generate(
            input_ids=ask.input_ids,
            max_tokens=ask.max_tokens,
            ignore_eos=True,
            stream=True,
            request_id=request_id,
        ):
            if isinstance(reply, TokenReply):
                streamed.append(reply)
                if len(streamed) == 1:
                    assert (await client.cancel(request_id)).request_id == request_id
            else:
                result = reply
        assert result.finish_reason == "cancelled" and 1 <= len(result.token_ids) < 2000
        # The tokens it made are the model's, and they were all streamed.
        assert_model_tokens(tiny, ask, result.token_ids)
        assert [token for reply in streamed for token in reply.token_ids] == result.token_ids
        with pytest.raises(ControlError) as gone:
            await client.cancel(request_id)
        assert (gone.value.code, gone.value.message) == ("not_found", f"no live request {request_id!r}")
        later = await send(client, distinct_asks(1, max_tokens=4, offset=150)[0])
        assert_correct(tiny, [later], transport="inproc")
        await wait_idle(client)
    (event,) = [e for e in node.events("request_cancelled") if e["request_id"] == request_id]
    assert (event["reason"], event["output_tokens"]) == ("cancel_op", len(result.token_ids))


async def test_more_live_requests_than_max_queue_are_overloaded(
    tiny_inproc_node: NodeProcess, tiny: Model
) -> None:
    """With the decode replicas locked, MAX_QUEUE requests stay live (prefilled, waiting to migrate);
    one more is refused `overloaded`; once unlocked, the MAX_QUEUE finish correctly. (Three connections:
    one connection has at most --max-outbound-replies requests in flight.)"""
    node = tiny_inproc_node
    held: list[Outcome] = []
    asks = distinct_asks(MAX_QUEUE, max_tokens=2, offset=500)
    async with node.client() as client, node.client() as second, node.client() as third:
        for decoder in ("decode-0", "decode-1"):
            await client.lock(decoder)
        async with trio.open_nursery() as nursery:
            for index, connection in enumerate((client, second, third)):
                launch(nursery, connection, asks[index::3], held)
            await wait_status(
                client,
                lambda s: by_name(s)["prefill-0"].migration_queue == MAX_QUEUE,
                f"{MAX_QUEUE} requests prefilled and waiting",
            )
            with pytest.raises(ControlError) as refused:
                await client.generate_result(input_ids=[1, 2, 3], max_tokens=2, request_id="one-too-many")
            assert (refused.value.code, refused.value.message, refused.value.request_id) == (
                "overloaded",
                f"{MAX_QUEUE} requests are in flight (max_queue {MAX_QUEUE}); retry later",
                "one-too-many",
            )
            for decoder in ("decode-0", "decode-1"):
                await client.unlock(decoder)
        assert_correct(tiny, held, transport="inproc")
        await wait_idle(client)


async def test_a_client_that_half_closes_gets_its_generate_cancelled_under_the_id_the_node_gave_it(
    tiny_inproc_node: NodeProcess,
) -> None:
    """End of stream from the client cancels its requests; the `cancelled` error of a generate that named
    no `request_id` names the one the node assigned (it said null), the id its log events carry."""
    node = tiny_inproc_node
    seen = {event["request_id"] for event in node.events("request_arrived")}
    async with raw_connection(node) as raw:
        await raw.send(
            b'{"op":"generate","id":"g","input_ids":[9,8,7],"max_tokens":20000,"ignore_eos":true}\n'
        )
        arrived = await node.wait_event("request_arrived", lambda e: e["request_id"] not in seen)
        await raw.stream.send_eof()
        (reply,) = await raw.closed()
    assert reply == {
        "type": "error",
        "id": "g",
        "code": "cancelled",
        "message": "cancelled: the client closed the connection",
        "request_id": arrived["request_id"],
    }
    cancelled = await node.wait_event("request_cancelled", lambda e: e["request_id"] == arrived["request_id"])
    assert cancelled["reason"] == "client_disconnected"
    async with node.client() as client:
        await wait_idle(client)
