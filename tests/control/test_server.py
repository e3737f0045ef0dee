"""The control server over real TCP and unix sockets (architecture §7): bad input, limits, slow and vanishing
clients, handler failures, shutdown. The handler is the small one in conftest.py."""

from __future__ import annotations

import random
import re
import socket
from pathlib import Path

import pytest
import trio

from engine.config import ControlConfig
from engine.config.address import TcpAddress, UnixAddress
from engine.control.server import ControlServer, ControlServerError
from messages.log.events import (
    ClientDisconnected,
    ControlBadLine,
    ControlHandlerError,
    SlowClient,
)
from tests.control.conftest import Handler, RawClient, Served, start_server
from tests.waiting import deadline, wait_until

KNOWN_OPS = "generate, status, cancel, transition, lock, unlock, scale, metrics, shutdown, release"
STATUS = b'{"op":"status","id":"ok"}'

BAD_LINES: list[tuple[bytes, str | None, str]] = [
    (
        b"hello, this is not json",
        None,
        "the line is not valid JSON: JSON is malformed: invalid character (byte 0)",
    ),
    (
        b"\x89PNG\r\x1a\x00\x00\xff\xfe binary",
        None,
        "the line is not valid UTF-8: byte 0x89 at offset 0",
    ),
    (
        b'{"op":"generate","id":"u","prompt":"\xc3\x28"}',
        "u",
        "the line is not valid UTF-8: byte 0xc3 at offset 36",
    ),
    (b'{"op":"fly","id":"f"}', "f", f"unknown op 'fly'; known ops: {KNOWN_OPS}"),
    (b'{"id":"n"}', "n", f'the request has no "op"; known ops: {KNOWN_OPS}'),
    (b'{"op":"status"}', None, "invalid request: Object missing required field `id`"),
    (b'{"op":"lock","id":"l"}', "l", "invalid request: Object missing required field `replica`"),
    (
        b'{"op":"generate","id":"w","prompt":["a"]}',
        "w",
        "invalid request: Expected `str | null`, got `array` - at `$.prompt`",
    ),
    (
        b'{"op":"generate","id":"b","prompt":"x","stream":"yes"}',
        "b",
        "invalid request: Expected `bool`, got `str` - at `$.stream`",
    ),
    (
        b'{"op":"generate","id":"m","prompt":"x","max_tokens":-1}',
        "m",
        "invalid request: Expected `int` >= 1 - at `$.max_tokens`",
    ),
    (
        b'{"op":"generate","id":"a","prompt":"x","max_tokens":99999999999}',
        "a",
        "invalid request: Expected `int` <= 1048576 - at `$.max_tokens`",
    ),
    (
        b'{"op":"generate","id":"t","prompt":"x","temperature":1e308}',
        "t",
        "invalid request: Expected `float` <= 10.0 - at `$.temperature`",
    ),
    (
        b'{"op":"generate","id":"i","input_ids":[1,-2]}',
        "i",
        "invalid request: Expected `int` >= 0 - at `$.input_ids[1]`",
    ),
    (
        b'{"op":"generate","id":"e","prompt":"x","seed":-5}',
        "e",
        "invalid request: Expected `int` >= 0 - at `$.seed`",
    ),
    (b"[]", None, 'a request must be a JSON object with "op" and "id"; got a JSON array'),
]


async def test_bad_lines_get_errors_and_the_connection_keeps_working(served: Served, raw: RawClient) -> None:
    await raw.send(*(line for line, _, _ in BAD_LINES), b"", b"   ", STATUS)
    for line, client_id, message in BAD_LINES:
        assert await raw.reply() == {
            "type": "error",
            "id": client_id,
            "code": "bad_request",
            "message": message,
            "request_id": None,
        }, line
    status = await raw.reply()
    assert (status["type"], status["id"], status["replicas"][0]["name"]) == ("result", "ok", "decode-0")
    logged = [event for event in served.events() if isinstance(event, ControlBadLine)]
    assert [(event.id, event.message) for event in logged] == [
        (cid, message) for _, cid, message in BAD_LINES
    ]


async def test_random_garbage_lines_each_get_one_error(served: Served, raw: RawClient) -> None:
    rng = random.Random(20261122)
    garbage = [
        bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))).replace(b"\n", b"")
        for _ in range(100)
    ]
    garbage = [line for line in garbage if line.strip()]
    await raw.send(*garbage, STATUS)
    for _ in garbage:
        reply = await raw.reply()
        assert (reply["type"], reply["code"]) == ("error", "bad_request")
    assert (await raw.reply())["id"] == "ok"


async def test_an_oversized_line_closes_only_its_own_connection(
    nursery: trio.Nursery, short_dir: Path
) -> None:
    served = await start_server(nursery, TcpAddress(host="127.0.0.1", port=0), short_dir, max_line_bytes=1024)
    bystander = await RawClient.open(served.address)
    offender = await RawClient.open(served.address)
    exact = b'{"op":"status","id":"edge"' + b" " * (1024 - 27) + b"}"
    assert len(exact) == 1024
    await offender.send(exact, b'{"op":"status","id":"big","pad":"' + b"x" * 2000 + b'"}', STATUS)
    by_type = {reply["type"]: reply for reply in [await offender.reply(), await offender.reply()]}
    edge, error = by_type["result"], by_type["error"]
    assert (edge["id"], edge["type"]) == ("edge", "result")  # a request before the long line still finishes
    assert (error["id"], error["code"]) == (None, "bad_request")
    # How much had arrived when the limit tripped depends on how the kernel split the bytes.
    assert re.fullmatch(
        r"line longer than 1024 bytes \((read \d+ bytes without a newline|\d+ bytes before its newline)\); "
        r"the limit is --max-line-bytes; closing the connection",
        error["message"],
    )
    assert await offender.at_eof()
    await bystander.send(STATUS)
    assert (await bystander.reply())["id"] == "ok"
    latecomer = await RawClient.open(served.address)
    await latecomer.send(STATUS)
    assert (await latecomer.reply())["id"] == "ok"
    for client in (bystander, offender, latecomer):
        await client.aclose()
    reasons = [event.reason for event in served.events() if isinstance(event, ClientDisconnected)]
    assert "line_too_long" in reasons


async def test_streaming_and_concurrent_requests_on_one_connection(served: Served, raw: RawClient) -> None:
    await raw.send(
        b'{"op":"generate","id":"g1","prompt":"p","max_tokens":5,"stream":true,"request_id":"r1"}',
        b'{"op":"generate","id":"g2","input_ids":[3,4],"max_tokens":2}',
        STATUS,
    )
    replies = [await raw.reply() for _ in range(5 + 1 + 1 + 1)]
    by_id: dict[str, list[dict[str, object]]] = {}
    for reply in replies:
        by_id.setdefault(str(reply["id"]), []).append(reply)
    assert [r["type"] for r in by_id["g1"]] == ["token"] * 5 + ["result"]
    assert [r["index"] for r in by_id["g1"][:5]] == [0, 1, 2, 3, 4]
    assert by_id["g1"][-1]["request_id"] == "r1"
    assert by_id["g1"][-1]["token_ids"] == [0, 1, 2, 3, 4]
    assert [r["type"] for r in by_id["g2"]] == ["result"]
    assert by_id["g2"][0]["prompt_tokens"] == 2
    assert [r["type"] for r in by_id["ok"]] == ["result"]


async def test_an_id_already_in_flight_is_refused(served: Served, raw: RawClient) -> None:
    await raw.send(b'{"op":"generate","id":"dup","prompt":"sleep"}', b'{"op":"status","id":"dup"}')
    assert await raw.reply() == {
        "type": "error",
        "id": "dup",
        "code": "bad_request",
        "request_id": None,
        "message": "id 'dup' is already in flight on this connection",
    }
    await raw.send(b'{"op":"cancel","id":"c","request_id":"req-dup"}')
    replies = await raw.by_id(2)
    assert replies["dup"]["finish_reason"] == "cancelled"
    assert replies["c"] == {"type": "result", "id": "c", "request_id": "req-dup"}


async def test_cancel_from_another_connection(served: Served, raw: RawClient) -> None:
    await raw.send(b'{"op":"generate","id":"long","prompt":"sleep","request_id":"job-7"}')
    await served.handler.wait("started", "long")
    other = await RawClient.open(served.address)
    await other.send(
        b'{"op":"cancel","id":"c1","request_id":"job-7"}', b'{"op":"cancel","id":"c2","request_id":"nope"}'
    )
    assert await other.by_id(2) == {
        "c1": {"type": "result", "id": "c1", "request_id": "job-7"},
        "c2": {
            "type": "error",
            "id": "c2",
            "code": "not_found",
            "message": "no live request 'nope'",
            "request_id": None,
        },
    }
    result = await raw.reply()
    assert (result["id"], result["finish_reason"]) == ("long", "cancelled")
    await other.aclose()


async def test_a_client_that_stops_reading_has_its_requests_cancelled(
    nursery: trio.Nursery, short_dir: Path
) -> None:
    served = await start_server(
        nursery, TcpAddress(host="127.0.0.1", port=0), short_dir, max_outbound_replies=4
    )
    client = await RawClient.open(served.address, receive_buffer=4096)
    await client.send(b'{"op":"generate","id":"flood","prompt":"forever","stream":true}')
    await served.handler.wait("cancelled", "flood", 20)
    await served.handler.wait("cleaned", "flood", 20)
    # Reading again: the queued tokens, then the request's final `cancelled` error; the connection lives.
    replies = await client.until_final()
    assert all(reply["type"] == "token" for reply in replies[:-1])
    assert replies[-1]["code"] == "cancelled"
    assert replies[-1]["message"].startswith(
        "cancelled: the client stopped reading its replies (4 were waiting;"
    )
    await client.send(STATUS)
    assert (await client.reply())["id"] == "ok"
    await client.aclose()
    slow = [event for event in served.events() if isinstance(event, SlowClient)]
    assert [(event.queued_replies, event.cancelled_requests) for event in slow] == [(4, 1)]


async def test_a_client_that_disconnects_mid_stream_has_its_requests_cancelled(served: Served) -> None:
    client = await RawClient.open(served.address)
    await client.send(
        b'{"op":"generate","id":"s","prompt":"forever","stream":true}',
        b'{"op":"generate","id":"q","prompt":"sleep"}',
    )
    assert (await client.reply())["type"] == "token"
    await served.handler.wait("started", "q")
    await client.aclose()
    await served.handler.wait("cancelled", "s")
    await served.handler.wait("cancelled", "q")
    await wait_until(
        lambda: any(isinstance(event, ClientDisconnected) for event in served.events()),
        "the server logging the client's disconnection",
        10,
    )
    assert served.handler.cleaned["s"].is_set() and served.handler.cleaned["q"].is_set()
    (gone,) = [event for event in served.events() if isinstance(event, ClientDisconnected)]
    assert gone.reason in ("eof", "broken")
    assert gone.cancelled_requests == 2
    assert served.server.in_flight == 0


@pytest.mark.parametrize(
    ("prompt", "code", "message"),
    [
        ("fail", "overloaded", "the queue is full (test)"),
        ("crash", "internal", "internal error in generate: RuntimeError('boom')"),
        ("silent", "internal", "the node sent no reply to generate"),
    ],
)
async def test_handler_failures_become_error_replies(
    served: Served, raw: RawClient, prompt: str, code: str, message: str
) -> None:
    await raw.send(f'{{"op":"generate","id":"h","prompt":"{prompt}"}}'.encode(), STATUS)
    replies = await raw.by_id(2)
    assert replies["h"] == {"type": "error", "id": "h", "code": code, "message": message, "request_id": None}
    assert replies["ok"]["type"] == "result"
    await raw.send(b'{"op":"status","id":"after"}')
    assert (await raw.reply())["id"] == "after"  # no second final reply for "h"
    crashes = [event for event in served.events() if isinstance(event, ControlHandlerError)]
    assert len(crashes) == (prompt == "crash")


async def test_a_second_final_reply_is_refused_and_reported(served: Served, raw: RawClient) -> None:
    await raw.send(b'{"op":"generate","id":"tw","prompt":"twice","max_tokens":1}')
    assert (await raw.reply())["type"] == "result"
    await raw.send(STATUS)  # the second result of "tw" was refused: the next line is the status
    assert (await raw.reply())["id"] == "ok"
    (crash,) = [event for event in served.events() if isinstance(event, ControlHandlerError)]
    assert crash.error.startswith("ReplyAfterFinal(\"request 'tw' (generate) already sent its final reply")


async def test_ops_the_handler_refuses(served: Served, raw: RawClient) -> None:
    await raw.send(b'{"op":"scale","id":"sc","role":"decode","replicas":2}')
    assert await raw.reply() == {
        "type": "error",
        "id": "sc",
        "code": "not_supported",
        "message": "scale is not supported here",
        "request_id": None,
    }


async def test_stop_accepting_keeps_open_connections_serving(served: Served, raw: RawClient) -> None:
    await raw.send(b'{"op":"shutdown","id":"down"}')
    assert await raw.reply() == {"type": "result", "id": "down", "drain_deadline_s": 0.0, "in_flight": 0}
    await trio.sleep(0.05)
    with pytest.raises(OSError):
        await RawClient.open(served.address)
    if isinstance(served.address, UnixAddress):
        assert not Path(served.address.path).exists()
    await raw.send(STATUS)
    assert (await raw.reply())["id"] == "ok"


async def test_close_ends_in_flight_requests_with_their_final_reply_and_serve_returns(
    short_dir: Path,
) -> None:
    returned = trio.Event()
    async with trio.open_nursery() as nursery:

        async def serve_then_mark(served_box: list[Served]) -> None:
            async with trio.open_nursery() as inner:
                served_box.append(await start_server(inner, TcpAddress(host="127.0.0.1", port=0), short_dir))
            returned.set()

        box: list[Served] = []
        nursery.start_soon(serve_then_mark, box)
        served = (await wait_until(lambda: box, "the server started"))[0]
        client = await RawClient.open(served.address)
        await client.send(b'{"op":"generate","id":"z","prompt":"sleep"}')
        await served.handler.wait("started", "z")
        served.server.close()
        with deadline("serve returning once the server closed", 10):
            await returned.wait()
        assert served.handler.cancelled["z"].is_set() and served.handler.cleaned["z"].is_set()
        # The request's final reply is sent before the connection closes (the node's drain relies on it).
        assert await client.reply() == {
            "type": "error",
            "id": "z",
            "code": "cancelled",
            "message": "cancelled: the server is closing",
            "request_id": None,
        }
        assert await client.at_eof()
        await client.aclose()
    (gone,) = [event for event in served.events() if isinstance(event, ClientDisconnected)]
    assert gone.reason == "server_closing"


async def test_a_stuck_client_is_dropped_after_the_write_timeout(
    nursery: trio.Nursery, short_dir: Path, autojump_clock: trio.testing.MockClock
) -> None:
    served = await start_server(
        nursery,
        TcpAddress(host="127.0.0.1", port=0),
        short_dir,
        client_write_timeout=5.0,
        max_outbound_replies=1000,
    )
    client = await RawClient.open(served.address, receive_buffer=4096)
    await client.send(b'{"op":"generate","id":"h","prompt":"huge","stream":true}')
    await served.handler.wait("cancelled", "h", 60)  # virtual seconds (autojump_clock)
    await wait_until(
        lambda: any(isinstance(e, ClientDisconnected) for e in served.events()),
        "the server logging the stuck client's disconnection",
        60,
        interval=1,
    )
    (gone,) = [event for event in served.events() if isinstance(event, ClientDisconnected)]
    assert gone.reason == "write_timeout"
    await client.aclose()


async def test_unix_socket_files_stale_live_and_foreign(nursery: trio.Nursery, short_dir: Path) -> None:
    path = short_dir / "s.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # the file stays, nobody listens: a crashed server's leftover
    served = await start_server(nursery, UnixAddress(path=str(path)), short_dir)
    second = ControlServer(Handler(), ControlConfig(), served.log)
    with pytest.raises(
        ControlServerError, match=rf"^cannot listen on unix:{path}: another server is listening there$"
    ):
        await second.serve(UnixAddress(path=str(path)))
    foreign = short_dir / "not-a-socket"
    foreign.write_text("keep me")
    with pytest.raises(ControlServerError, match="the path exists and is not a socket"):
        await second.serve(UnixAddress(path=str(foreign)))
    assert foreign.read_text() == "keep me"
    client = await RawClient.open(served.address)
    await client.send(STATUS)
    assert (await client.reply())["id"] == "ok"
    await client.aclose()


async def test_a_tcp_port_in_use_is_a_clear_error(nursery: trio.Nursery, short_dir: Path) -> None:
    served = await start_server(nursery, TcpAddress(host="127.0.0.1", port=0), short_dir)
    assert isinstance(served.address, TcpAddress)
    other = ControlServer(Handler(), ControlConfig(), served.log)
    with pytest.raises(ControlServerError, match=rf"^cannot listen on 127.0.0.1:{served.address.port}: "):
        await other.serve(served.address)
