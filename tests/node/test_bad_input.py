"""Bad input on the control socket of a real node (`tiny_inproc_node`: 4 KiB lines, 16 queued replies).

Every bad line gets an `error` reply on the same connection, which keeps working; only a line over the
size limit closes it, after its error and the replies of the requests already in flight. A client that
stops reading or disconnects while streaming has its requests cancelled; `cancel` ends a generate
mid-way. After each, the node still serves correctly and every replica's blocks return (used_blocks 0).
"""

from __future__ import annotations

import re
import uuid
from functools import partial
from typing import Any

import msgspec
import pytest
import trio

from engine.client import ControlError
from messages.control_replies import GenerateResult, TokenReply
from replicas.model import Model
from tests.node.conftest import MAX_LINE_BYTES, MAX_OUTBOUND_REPLIES, MAX_QUEUE
from tests.node.harness import NodeProcess, by_name, raw_connection, wait_idle, wait_serving, wait_status
from tests.node.workload import Ask, Outcome, assert_correct, assert_model_tokens, distinct_asks, launch, send

OPS = "generate, status, cancel, transition, lock, unlock, scale, metrics, shutdown"
STATES = (
    "Inactive, LoadingPrefill, LoadingDecode, LoadingEncode, Prefill, Decode, Encode, NewPrefill, OldPrefill, "
    "RefractoryPrefill, MutatingToDecode, AusPrefill, AusDecode, ShuttingPrefill, ShuttingDecode, "
    "ShuttingEncode, ShuttingNull"
)
GARBAGE = bytes(b for b in range(256) if b not in b"\r\n")

# (line, reply id, code, message, reply request_id)
BAD_LINES: list[tuple[bytes, str | None, str, str, str | None]] = [
    (
        b"hello",
        None,
        "bad_request",
        "the line is not valid JSON: JSON is malformed: invalid character (byte 0)",
        None,
    ),
    (
        b"[1,2]",
        None,
        "bad_request",
        'a request must be a JSON object with "op" and "id"; got a JSON array',
        None,
    ),
    (b"{}", None, "bad_request", f'the request has no "op"; known ops: {OPS}', None),
    (b'{"op":"fly","id":"u"}', "u", "bad_request", f"unknown op 'fly'; known ops: {OPS}", None),
    (b'{"op":"status"}', None, "bad_request", "invalid request: Object missing required field `id`", None),
    (
        b'{"op":"status","id":7}',
        None,
        "bad_request",
        "invalid request: Expected `str`, got `int` - at `$.id`",
        None,
    ),
    (
        b'{"op":"generate","id":"w","prompt":["a"]}',
        "w",
        "bad_request",
        "invalid request: Expected `str | null`, got `array` - at `$.prompt`",
        None,
    ),
    (
        b'{"op":"generate","id":"w2","prompt":"x","stream":"yes"}',
        "w2",
        "bad_request",
        "invalid request: Expected `bool`, got `str` - at `$.stream`",
        None,
    ),
    (
        b'{"op":"lock","id":"l"}',
        "l",
        "bad_request",
        "invalid request: Object missing required field `replica`",
        None,
    ),
    (
        b'{"op":"generate","id":"neither"}',
        "neither",
        "bad_request",
        "invalid request: generate needs exactly one of `prompt` or `input_ids`; neither was given",
        None,
    ),
    (
        b'{"op":"generate","id":"extra","prompt":"x","colour":"red"}',
        "extra",
        "bad_request",
        "invalid request: Object contains unknown field `colour`",
        None,
    ),
    (
        b'{"op":"generate","id":"m","prompt":"x","max_tokens":-1}',
        "m",
        "bad_request",
        "invalid request: Expected `int` >= 1 - at `$.max_tokens`",
        None,
    ),
    (
        b'{"op":"generate","id":"m2","prompt":"x","max_tokens":100000000000000000000000000000}',
        "m2",
        "bad_request",
        "invalid request: Expected `int` <= 1048576 - at `$.max_tokens`",
        None,
    ),
    (
        b'{"op":"generate","id":"t","prompt":"x","temperature":1e300}',
        "t",
        "bad_request",
        "invalid request: Expected `float` <= 10.0 - at `$.temperature`",
        None,
    ),
    (
        b'{"op":"generate","id":"p","prompt":"x","top_p":0}',
        "p",
        "bad_request",
        "invalid request: Expected `float` > 0.0 - at `$.top_p`",
        None,
    ),
    (
        b'{"op":"generate","id":"s","prompt":"x","seed":-5}',
        "s",
        "bad_request",
        "invalid request: Expected `int` >= 0 - at `$.seed`",
        None,
    ),
    (
        b'{"op":"generate","id":"neg","input_ids":[1,-1]}',
        "neg",
        "bad_request",
        "invalid request: Expected `int` >= 0 - at `$.input_ids[1]`",
        None,
    ),
    (
        b'{"op":"generate","id":"big","input_ids":[1,4294967296]}',
        "big",
        "bad_request",
        "invalid request: Expected `int` <= 2147483647 - at `$.input_ids[1]`",
        None,
    ),
    (
        b'{"op":"generate","id":"oov","input_ids":[1,2,300],"request_id":"bad-oov"}',
        "oov",
        "bad_request",
        "input_ids[2] = 300 is outside the vocabulary of 260 tokens",
        "bad-oov",
    ),
    (
        b'{"op":"generate","id":"ep","prompt":"","request_id":"bad-empty"}',
        "ep",
        "bad_request",
        "prompt is empty",
        "bad-empty",
    ),
    (
        b'{"op":"scale","id":"sc","role":"decode","replicas":1000}',
        "sc",
        "bad_request",
        "invalid request: Expected `int` <= 64 - at `$.replicas`",
        None,
    ),
    (
        b'{"op":"transition","id":"tr","replica":"decode-0","to":"Flying"}',
        "tr",
        "bad_request",
        f"invalid request: Invalid enum value 'Flying' - at `$.to`; valid states: {STATES}",
        None,
    ),
    (
        b'{"op":"lock","id":"lk","replica":"decode-7"}',
        "lk",
        "not_found",
        "no replica 'decode-7'; replicas are prefill-0, decode-0, decode-1",
        None,
    ),
    (b'{"op":"cancel","id":"c","request_id":"no-such"}', "c", "not_found", "no live request 'no-such'", None),
    (
        b'{"op":"status","id":"\xc3("}',
        None,
        "bad_request",
        "the line is not valid UTF-8: byte 0xc3 at offset 21",
        None,
    ),
    (
        GARBAGE,
        None,
        "bad_request",
        "the line is not valid JSON: JSON is malformed: invalid character (byte 0)",
        None,
    ),
    (
        b'{"op":"status","id":"s1"}{"op":"status","id":"s2"}',
        None,
        "bad_request",
        "the line is not valid JSON: JSON is malformed: trailing characters (byte 26)",
        None,
    ),
]


def names_request(request_id: str, event: dict[str, Any]) -> bool:
    return bool(event["request_id"] == request_id)


async def still_serving(node: NodeProcess, model: Model, *, offset: int) -> None:
    """The node serves a request correctly, then every replica is idle with no block held."""
    async with node.client() as client:
        await wait_serving(client)
        outcome = await send(client, distinct_asks(1, max_tokens=3, offset=offset)[0])
        assert_correct(model, [outcome], transport="inproc")
        await wait_idle(client)


async def test_every_bad_line_gets_an_error_and_the_connection_keeps_working(
    tiny_inproc_node: NodeProcess, tiny: Model
) -> None:
    node = tiny_inproc_node
    bad_lines_before = len(node.events("control_bad_line"))
    async with raw_connection(node) as raw:
        for line, reply_id, code, message, request_id in BAD_LINES:
            reply = await raw.ask(line + b"\n")
            assert reply == {
                "type": "error",
                "id": reply_id,
                "code": code,
                "message": message,
                "request_id": request_id,
            }, line
        await raw.send(
            b'{"op":"generate","id":"good","input_ids":[5,6,7,8],"max_tokens":3,"ignore_eos":true}\n'
        )
        reply = await raw.reply()
        assert (reply["type"], reply["id"], reply["finish_reason"]) == ("result", "good", "length")
        assert_correct(
            tiny,
            [
                Outcome(
                    Ask(input_ids=(5, 6, 7, 8), max_tokens=3, ignore_eos=True),
                    msgspec.convert(reply, GenerateResult),
                )
            ],
            transport="inproc",
        )
    unreadable = sum(
        1 for _, _, _, message, _ in BAD_LINES if not message.startswith(("no ", "input_ids[", "prompt is"))
    )
    assert len(node.events("control_bad_line")) - bad_lines_before == unreadable
    failed = {e["request_id"]: e["code"] for e in node.events("request_failed")}
    assert failed["bad-oov"] == failed["bad-empty"] == "bad_request"
    await still_serving(node, tiny, offset=100)


async def test_an_id_or_request_id_already_in_flight_is_refused(
    tiny_inproc_node: NodeProcess, tiny: Model
) -> None:
    node = tiny_inproc_node
    request_id = f"dup-{uuid.uuid4().hex[:8]}"
    first = (
        b'{"op":"generate","id":"dup","input_ids":[9,8,7],"max_tokens":30,"ignore_eos":true,"stream":true,'
        b'"request_id":"' + request_id.encode() + b'"}\n'
    )
    async with raw_connection(node) as raw:
        await raw.send(first + b'{"op":"status","id":"dup"}\n')
        refused = await raw.reply()
        assert refused == {
            "type": "error",
            "id": "dup",
            "code": "bad_request",
            "message": "id 'dup' is already in flight on this connection",
            "request_id": None,
        }
        assert (await raw.reply())["type"] == "token"  # the first one is live
        async with node.client() as client:
            with pytest.raises(ControlError) as again:
                await client.generate_result(input_ids=[1, 2], max_tokens=2, request_id=request_id)
        assert (again.value.code, again.value.message, again.value.request_id) == (
            "bad_request",
            f"request_id {request_id!r} is already in use",
            request_id,
        )
        replies = [await raw.reply()]
        while replies[-1]["type"] == "token":
            replies.append(await raw.reply())
        assert (replies[-1]["type"], len(replies[-1]["token_ids"])) == ("result", 30)
    await still_serving(node, tiny, offset=110)


async def test_an_oversized_line_gets_an_error_then_closes_its_connection(
    tiny_inproc_node: NodeProcess, tiny: Model
) -> None:
    node = tiny_inproc_node
    async with raw_connection(node) as raw:
        await raw.send(
            b'{"op":"generate","id":"before","input_ids":[3,4,5],"max_tokens":12,"ignore_eos":true}\n'
            + b"x" * (2 * MAX_LINE_BYTES)
            + b"\n"
        )
        replies = await raw.closed()
    errors = [r for r in replies if r["type"] == "error"]
    assert len(errors) == 1 and errors[0]["id"] is None and errors[0]["code"] == "bad_request"
    assert re.fullmatch(
        rf"line longer than {MAX_LINE_BYTES} bytes \(read \d+ bytes without a newline\); the limit is "
        r"--max-line-bytes; closing the connection",
        errors[0]["message"],
    ), errors[0]["message"]
    # The request already in flight finished before the connection closed.
    (result,) = [r for r in replies if r["type"] == "result"]
    assert (result["id"], len(result["token_ids"])) == ("before", 12)
    disconnected = await node.wait_event("client_disconnected", lambda e: e["reason"] == "line_too_long")
    assert disconnected["cancelled_requests"] == 0
    await still_serving(node, tiny, offset=120)


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
