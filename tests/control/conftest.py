"""A real control server on a real TCP or unix socket, with a small handler written for the tests.

The handler's behaviour is chosen by the generate prompt (``forever``, ``huge``, ``sleep``, ``crash``,
``silent``, ``fail``, ``twice``; anything else streams `max_tokens` tokens); it records when each request starts, is cancelled and
finishes its shielded cleanup, which is what the tests check against what the server does.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Literal

import msgspec
import pytest
import trio

from engine.config import ControlConfig
from engine.config.address import Address, TcpAddress, UnixAddress
from engine.control.errors import ClientGone, RequestFailed
from engine.control.lines import LineReader
from engine.control.outbox import ReplySink
from engine.control.server import ControlServer
from engine.logging import EventLog, open_event_log
from messages.control import (
    CancelRequest,
    ControlRequest,
    GenerateRequest,
    ShutdownRequest,
    StatusRequest,
)
from messages.control_replies import (
    CancelResult,
    GenerateResult,
    ReplicaStatus,
    ShutdownResult,
    StatusResult,
    Timings,
    TokenReply,
)
from messages.log.events import LogEvent, event_decoder
from tests.waiting import deadline

BIG_TEXT = "z" * 65536


class Handler:
    """Serves requests the way the tests ask, and records what happened to each (by client id)."""

    def __init__(self) -> None:
        self.started: dict[str, trio.Event] = {}
        self.cancelled: dict[str, trio.Event] = {}
        self.cleaned: dict[str, trio.Event] = {}
        self.scopes: dict[str, trio.CancelScope] = {}
        self.server: ControlServer | None = None

    def event(self, table: dict[str, trio.Event], request_id: str) -> trio.Event:
        return table.setdefault(request_id, trio.Event())

    async def wait(
        self, what: Literal["started", "cancelled", "cleaned"], request_id: str, seconds: float = 10
    ) -> None:
        """Until request `request_id` (its client id) has started, been cancelled or finished its
        cleanup; fails naming which after `seconds`."""
        with deadline(f"request {request_id!r} {what}", seconds):
            await self.event(getattr(self, what), request_id).wait()

    async def handle(self, request: ControlRequest, replies: ReplySink) -> None:
        match request:
            case GenerateRequest():
                await self._generate(request, replies)
            case StatusRequest():
                replica = ReplicaStatus(
                    name="decode-0",
                    role="decode",
                    state="Decode",
                    used_blocks=0,
                    cached_blocks=0,
                    total_blocks=64,
                    locked=False,
                    lock_reasons=[],
                    work_queue=0,
                    migration_queue=0,
                    last_error=None,
                    transport="inproc",
                )
                replies.send(StatusResult(id=request.id, accepting=True, replicas=[replica]))
            case CancelRequest():
                scope = self.scopes.get(request.request_id)
                if scope is None:
                    raise RequestFailed("not_found", f"no live request {request.request_id!r}")
                scope.cancel()
                replies.send(CancelResult(id=request.id, request_id=request.request_id))
            case ShutdownRequest():
                assert self.server is not None
                self.server.stop_accepting()
                replies.send(
                    ShutdownResult(id=request.id, drain_deadline_s=0.0, in_flight=self.server.in_flight - 1)
                )
            case _:
                raise RequestFailed("not_supported", f"{request.__struct_config__.tag} is not supported here")

    async def _generate(self, request: GenerateRequest, replies: ReplySink) -> None:
        self.event(self.started, request.id).set()
        if request.prompt == "silent":
            return
        request_id = request.request_id or f"req-{request.id}"
        tokens: list[int] = []
        finish = "length"
        try:
            with trio.CancelScope() as scope:
                self.scopes[request_id] = scope
                await self._produce(request, replies, request_id, tokens)
            if scope.cancelled_caught:
                finish = "cancelled"
        except (trio.Cancelled, ClientGone):
            self.event(self.cancelled, request.id).set()
            raise
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(0)  # stands in for freeing blocks: must run despite the cancellation
                self.event(self.cleaned, request.id).set()
        replies.send(
            GenerateResult(
                id=request.id,
                request_id=request_id,
                prompt_tokens=len(request.input_ids or [0]),
                token_ids=tokens,
                text="".join(map(str, tokens))
                + "".join(f"[{i.width}x{i.height} {i.pixels.hex()}]" for i in request.images),
                finish_reason=finish,
                timings=Timings(e2e_s=0.0),
                transfers=[],
            )
        )
        if request.prompt == "twice":
            replies.send(
                GenerateResult(
                    id=request.id,
                    request_id=request_id,
                    prompt_tokens=1,
                    token_ids=[],
                    text="",
                    finish_reason="stop",
                    timings=Timings(),
                    transfers=[],
                )
            )

    async def _produce(
        self, request: GenerateRequest, replies: ReplySink, request_id: str, tokens: list[int]
    ) -> None:
        match request.prompt:
            case "crash":
                raise RuntimeError("boom")
            case "fail":
                raise RequestFailed("overloaded", "the queue is full (test)")
            case "sleep":
                await trio.sleep(1000)
            case "forever":  # a stream that yields between tokens (it paces itself, it waits for nothing)
                for index in itertools.count():
                    replies.send(
                        TokenReply(
                            id=request.id, request_id=request_id, index=index, token_ids=[7], text=BIG_TEXT
                        )
                    )
                    await trio.sleep(0)
            case "huge":  # one 16 MiB reply, more than the socket buffers hold, then nothing
                replies.send(
                    TokenReply(
                        id=request.id, request_id=request_id, index=0, token_ids=[7], text=BIG_TEXT * 256
                    )
                )
                await trio.sleep(1000)
        for index in range(request.max_tokens):
            tokens.append(index)
            if request.stream:
                replies.send(
                    TokenReply(
                        id=request.id, request_id=request_id, index=index, token_ids=[index], text=str(index)
                    )
                )
            await trio.sleep(0)


class Served(msgspec.Struct, kw_only=True):
    address: Address
    handler: Handler
    server: ControlServer
    log: EventLog
    log_path: Path

    def events(self) -> list[LogEvent]:
        self.log.flush()
        decoder = event_decoder()
        return [decoder.decode(line) for line in self.log_path.read_bytes().splitlines()]


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path (unix socket paths are limited to ~107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="zz-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def limits(**overrides: Any) -> ControlConfig:
    return msgspec.structs.replace(ControlConfig(), **overrides)


async def start_server(nursery: trio.Nursery, address: Address, log_dir: Path, **control: Any) -> Served:
    handler = Handler()
    log_path = log_dir / "events.jsonl"
    log = open_event_log(file=str(log_path), level="debug", console=None)
    server = ControlServer(handler, limits(**control), log)
    handler.server = server
    bound = await nursery.start(server.serve, address)
    return Served(address=bound, handler=handler, server=server, log=log, log_path=log_path)


@pytest.fixture(params=["tcp", "unix"])
async def served(request: pytest.FixtureRequest, nursery: trio.Nursery, short_dir: Path) -> Served:
    address: Address = (
        TcpAddress(host="127.0.0.1", port=0)
        if request.param == "tcp"
        else UnixAddress(path=str(short_dir / "c.sock"))
    )
    return await start_server(nursery, address, short_dir)


class RawClient:
    """Bytes in, decoded JSON objects out: a client that can send anything and stop reading at will."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.reader = LineReader(stream, 1 << 30)

    @classmethod
    async def open(cls, address: Address, *, receive_buffer: int | None = None) -> RawClient:
        if isinstance(address, TcpAddress):
            sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
            target: Any = (address.host, address.port)
        else:
            sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
            target = address.path
        if receive_buffer is not None:
            sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, receive_buffer)
        await sock.connect(target)
        return cls(trio.SocketStream(sock))

    async def send(self, *lines: bytes) -> None:
        await self.stream.send_all(b"".join(line + b"\n" for line in lines))

    async def reply(self) -> dict[str, Any]:
        with deadline("a reply line from the server", 10):
            line = await self.reader.next_line()
        assert line is not None, "the server closed the connection"
        decoded: dict[str, Any] = msgspec.json.decode(line)
        return decoded

    async def by_id(self, count: int) -> dict[str, dict[str, Any]]:
        """The next `count` replies, which must be final and of distinct requests, keyed by id."""
        replies = [await self.reply() for _ in range(count)]
        assert all(reply["type"] != "token" for reply in replies)
        return {reply["id"]: reply for reply in replies}

    async def until_final(self) -> list[dict[str, Any]]:
        replies = [await self.reply()]
        while replies[-1]["type"] == "token":
            replies.append(await self.reply())
        return replies

    async def at_eof(self) -> bool:
        with deadline("a line or the end of the connection from the server", 10):
            return await self.reader.next_line() is None

    async def aclose(self) -> None:
        await self.stream.aclose()


@pytest.fixture
async def raw(served: Served) -> AsyncIterator[RawClient]:
    client = await RawClient.open(served.address)
    yield client
    await client.aclose()
