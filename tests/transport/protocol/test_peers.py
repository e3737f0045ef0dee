"""Peers that misbehave at the wire level: a silent peer, a sender writing outside its grant, totals
that cannot fit. The misbehaving side is a hand-written peer speaking the real frame format."""

from __future__ import annotations

import socket

import pytest
import torch
import trio

from messages.peer_codec import decode_peer, encode_peer
from messages.transfer import ChunkDone, FailureReason, Grant, Hello, HelloAck, PeerMessage
from tests.transport.harness import (
    Collector,
    Source,
    embedding_layout,
    endpoint_pair,
    random_storage,
    send_all,
    settle,
    shuffled_pool,
)
from transport.bulk.frame_plan import SEGMENT
from transport.config import TransferConfig
from transport.endpoint import open_endpoint
from transport.errors import TransferFailed
from transport.links.tcp.frames import (
    BULK,
    CONTROL,
    HEADER,
    HEADER_BYTES,
    MAGIC,
    control_header,
    parse_header,
)

LAYOUT = embedding_layout(block_size=16)
FAST_LINKS = TransferConfig(heartbeat_interval=0.05, link_timeout=0.3)


class FakePeer:
    """One end of a TCP link driven by hand, frame by frame."""

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.stream = trio.SocketStream(sock)

    async def send(self, message: PeerMessage) -> None:
        body = encode_peer(message)
        await self.stream.send_all(control_header(len(body)) + body)

    async def send_bulk(
        self, landing_key: int, round: int, buffer: int, dst_row: int, payload: bytes
    ) -> None:
        """One bulk frame of one segment, exactly as `tcp_frames` lays it out."""
        rows = len(payload) // LAYOUT.buffers[buffer].bytes_per_token
        header = HEADER.pack(MAGIC, BULK, 0, len(payload), landing_key, round, buffer, 0, 1)
        await self.stream.send_all(header + SEGMENT.pack(dst_row, rows) + payload)

    async def _exactly(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = await self.stream.receive_some(size - len(data))
            if not chunk:
                raise EOFError("peer closed")
            data += chunk
        return data

    async def receive(self) -> PeerMessage:
        """The next control message (heartbeats skipped)."""
        while True:
            frame = parse_header(await self._exactly(HEADER_BYTES))
            body = await self._exactly(frame.length)
            if frame.kind == CONTROL:
                message = decode_peer(body)
                if type(message).__name__ != "Heartbeat":
                    return message


async def fake_sender(task_status: trio.TaskStatus[tuple[str, trio.MemoryReceiveChannel[FakePeer]]]) -> None:
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen()
    send, receive = trio.open_memory_channel[FakePeer](1)
    task_status.started((f"tcp://127.0.0.1:{listener.getsockname()[1]}", receive))
    with listener:
        sock, _ = await listener.accept()
        peer = FakePeer(sock)
        hello = await peer.receive()
        assert isinstance(hello, Hello)
        await peer.send(HelloAck(link_id=hello.link_id, endpoint="fake"))
        await send.send(peer)
        await trio.sleep_forever()


async def test_a_silent_peer_is_dropped_while_a_quiet_link_lives_on_heartbeats() -> None:
    storage, pool = random_storage(LAYOUT, 4, seed=1), shuffled_pool(4, 16, seed=1)
    async with (
        trio.open_nursery() as nursery,
        open_endpoint("receiver", storage, pool, config=FAST_LINKS) as receiver,
    ):
        address, peers = await nursery.start(fake_sender)
        silent = await receiver.connect(address)
        await peers.receive()
        source = Source(LAYOUT, 20, seed=2)
        async with open_endpoint("sender", source.storage, source.pool, config=FAST_LINKS) as sender:
            quiet = await receiver.connect(await sender.listen_tcp())
            await trio.sleep(1.0)  # over three link timeouts without a transfer
            assert silent.is_closed and "nothing received for" in str(silent.error)
            assert not quiet.is_closed
        nursery.cancel_scope.cancel()


async def test_bytes_outside_the_grant_fail_the_transfer_and_spare_the_link() -> None:
    storage, pool = random_storage(LAYOUT, 12, seed=3), shuffled_pool(12, 16, seed=3)
    before = {name: tensor.view(torch.uint8).clone() for name, tensor in storage.tensors.items()}
    async with trio.open_nursery() as nursery, open_endpoint("receiver", storage, pool) as receiver:
        address, peers = await nursery.start(fake_sender)
        link = await receiver.connect(address)
        peer = await peers.receive()

        async def hostile() -> None:
            grant = await peer.receive()
            assert isinstance(grant, Grant)
            outside = next(block for block in range(12) if block not in grant.blocks)
            row_bytes = LAYOUT.buffers[0].bytes_per_token
            await peer.send_bulk(grant.landing_key, 0, 0, outside * 16, b"\xff" * row_bytes)

        nursery.start_soon(hostile)
        with pytest.raises(
            TransferFailed,
            match=r"\(protocol_error\): round 0: bytes for rows 0..1 of block \d+, which are not granted",
        ):
            await receiver.receive("t", peer=link, consume=Collector())
        await settle()
        assert not link.is_closed
        for name, tensor in storage.tensors.items():
            assert torch.equal(tensor.view(torch.uint8), before[name]), (
                f"{name} was written outside the grant"
            )
        nursery.cancel_scope.cancel()
    assert pool.used_blocks == 0


async def test_a_chunk_that_disagrees_with_its_grant_is_a_protocol_error() -> None:
    storage, pool = random_storage(LAYOUT, 8, seed=4), shuffled_pool(8, 16, seed=4)
    async with trio.open_nursery() as nursery, open_endpoint("receiver", storage, pool) as receiver:
        address, peers = await nursery.start(fake_sender)
        link = await receiver.connect(address)
        peer = await peers.receive()

        async def liar() -> None:
            grant = await peer.receive()
            assert isinstance(grant, Grant)
            header = grant.header
            await peer.send(
                ChunkDone(transfer_id="t", round=0, offset=0, tokens=3, total_tokens=500, header=header)
            )

        nursery.start_soon(liar)
        with pytest.raises(TransferFailed, match=r"round 0: ChunkDone says 3 tokens, the grant needs 128"):
            await receiver.receive("t", peer=link, consume=Collector())
        nursery.cancel_scope.cancel()
    assert pool.used_blocks == 0


@pytest.mark.parametrize("mode", ["kept", "borrowed", "expected"])
async def test_totals_that_cannot_fit_or_disagree_fail_at_once(mode: str) -> None:
    source = Source(LAYOUT, 16 * 10, seed=5)
    storage, pool = random_storage(LAYOUT, 6, seed=6), shuffled_pool(6, 16, seed=6)
    failures: list[TransferFailed] = []

    async def send() -> None:
        try:
            await send_all(pair.sender, "t", source)
        except TransferFailed as exc:
            failures.append(exc)

    expected = {
        "kept": (FailureReason.TOO_LARGE, r"160 tokens cannot fit: the receiver can hold 96"),
        "borrowed": (FailureReason.TOO_LARGE, r"160 tokens cannot fit: the receiver can hold 48"),
        "expected": (FailureReason.PROTOCOL_ERROR, r"sender total 160 tokens, receiver expected 150"),
    }[mode]
    async with endpoint_pair("inproc", source, storage, pool) as pair:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            with pytest.raises(TransferFailed, match=expected[1]) as raised:
                if mode == "kept":
                    await pair.receiver.receive("t", peer=pair.link, owner="r")
                elif mode == "borrowed":
                    await pair.receiver.receive("t", peer=pair.link, blocks=pool.allocate(3, "r"))
                else:
                    await pair.receiver.receive("t", peer=pair.link, expected_tokens=150, owner="r")
        assert raised.value.reason is expected[0]
        await settle()
    assert failures[0].reason is expected[0]
    pool.free_owner("r")
    assert pool.used_blocks == 0


def test_socket_helpers_name_the_address() -> None:
    async def refused() -> None:
        from transport.links.tcp.link import connect

        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        with pytest.raises(OSError, match=rf"cannot connect to 127.0.0.1:{port}: Connection refused"):
            await connect("127.0.0.1", port)

    trio.run(refused)
