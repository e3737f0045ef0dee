"""Bad input on the control socket of a real node (`tiny_inproc_node`: 4 KiB lines, 16 queued replies).

Every bad line gets an `error` reply on the same connection, which keeps working; only a line over the
size limit closes it, after its error and the replies of the requests already in flight. After each,
the node still serves correctly and every replica's blocks return (used_blocks 0). Clients that stop
reading, disconnect or cancel: `test_slow_clients.py`.
"""

from __future__ import annotations

import re
import uuid

import msgspec
import pytest

from engine.client import ControlError
from messages.control_replies import GenerateResult
from replicas.model import Model
from tests.node.conftest import MAX_LINE_BYTES
from tests.node.harness import NodeProcess
from tests.node.raw import raw_connection
from tests.node.workload import (
    Ask,
    Outcome,
    assert_correct,
    still_serving,
)

OPS = "generate, status, cancel, transition, lock, unlock, scale, metrics, shutdown, release"
STATES = (
    "Inactive, LoadingPrefill, LoadingDecode, LoadingEncode, Prefill, Decode, Encode, NewPrefill, OldPrefill, "
    "RefractoryPrefill, MutatingToDecode, AusPrefill, AusDecode, ShuttingPrefill, ShuttingDecode, "
    "ShuttingEncode, ShuttingNull"
)
GARBAGE = bytes(b for b in range(256) if b not in b"\r\n")

# (line, reply id, code, message, reply request_id)
BAD_LINES: list[tuple[bytes, str | None, str, str, str | None]] = [
    (  # 1500 nested arrays: the parser's recursion guard used to end the node with the line
        b'{"op":"status","id":"deep","x":' + b"[" * 1500 + b"]" * 1500 + b"}",
        None,
        "bad_request",
        "invalid request: Object contains unknown field `x`",
        None,
    ),
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
        b'{"op":"generate","id":"gr","input_ids":[1],"request_id":"bad-grammar",'
        b'"grammar":{"type":"json","schema":"{\\"type\\": \\"nope\\"}"}}',
        "gr",
        "bad_request",
        "the JSON schema does not compile: Invalid type: nope",
        "bad-grammar",
    ),
    (
        b'{"op":"generate","id":"gk","input_ids":[1],"grammar":{"type":"yaml"}}',
        "gk",
        "bad_request",
        "invalid request: Invalid value 'yaml' - at `$.grammar.type`",
        None,
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
        GARBAGE,  # every byte but CR and LF: the first that is not UTF-8 is 0x80, after 0x00-0x7f less two
        None,
        "bad_request",
        "the line is not valid UTF-8: byte 0x80 at offset 126",
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
        1
        for _, _, _, message, _ in BAD_LINES
        if not message.startswith(("no ", "input_ids[", "prompt is", "the JSON schema"))
    )
    assert len(node.events("control_bad_line")) - bad_lines_before == unreadable
    failed = {e["request_id"]: e["code"] for e in node.events("request_failed")}
    assert failed["bad-oov"] == failed["bad-empty"] == failed["bad-grammar"] == "bad_request"
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
        rf"line longer than {MAX_LINE_BYTES} bytes \((read \d+ bytes without a newline|\d+ bytes before its newline)\); "
        r"the limit is "
        r"--max-line-bytes; closing the connection",
        errors[0]["message"],
    ), errors[0]["message"]
    # The request already in flight finished before the connection closed.
    (result,) = [r for r in replies if r["type"] == "result"]
    assert (result["id"], len(result["token_ids"])) == ("before", 12)
    disconnected = await node.wait_event("client_disconnected", lambda e: e["reason"] == "line_too_long")
    assert disconnected["cancelled_requests"] == 0
    await still_serving(node, tiny, offset=120)
