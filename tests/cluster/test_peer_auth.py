"""Peer links with credentials (engine.cluster.peers, docs/security.md), between real sockets on
loopback: members that share the secret (and certificates) exchange frames; a frame before
authentication, a dialer without the secret, a frame that claims another sender, a frame with a broken
MAC and an oversized frame each close their connection and are logged, and the listener serves the
members on."""

from __future__ import annotations

import struct
from pathlib import Path

import msgspec
import pytest
import structlog.testing
import trio
from hypothesis import given
from hypothesis import strategies as st

from engine.cluster.peers import MAX_FRAME_BYTES, FrameReader, PeerFrameError, PeerLinks
from engine.config import parse_node_config
from engine.config.credentials import node_credentials
from messages.cluster import CancelForward, PeerFrame
from tests.certs import make_ca, make_node_cert
from tests.waiting import deadline, wait_until
from transport.auth.challenge import AuthFailed
from transport.auth.credentials import Credentials
from transport.auth.frames import FrameSealer
from transport.auth.streams import admit_dialer

SECRET = b"peer-secret-0123456789abcdef"


def _cancel(request_id: str) -> CancelForward:
    return CancelForward(request_id=request_id)


async def _connected(
    address: str, credentials: Credentials, name: str
) -> tuple[trio.abc.Stream, FrameSealer]:
    host, _, port = address.rpartition(":")
    stream = await trio.open_tcp_stream(host, int(port))
    admitted = await admit_dialer(stream, credentials, purpose="peer", name=name, expect="dec")
    assert admitted.key is not None
    return admitted.stream, FrameSealer(admitted.key, "dialer")


async def _closed(stream: trio.abc.Stream) -> bool:
    """Whether the listener closed `stream` (it reads nothing more from it)."""
    with deadline("the listener closing the connection", 10):
        try:
            async for _ in stream:  # whatever it sends until it closes
                continue
        except trio.BrokenResourceError:
            pass
    return True


@pytest.mark.parametrize("tls", [False, True])
async def test_members_exchange_frames_and_every_forgery_closes_its_connection(
    tls: bool, tmp_path: Path, nursery: trio.Nursery
) -> None:
    def credentials(node: str) -> Credentials:
        if not tls:
            return Credentials(secret=SECRET)
        return Credentials(secret=SECRET, tls=make_node_cert(tmp_path, ca, node))

    ca = make_ca(tmp_path / "ca") if tls else None
    received: list[PeerFrame] = []
    pre_credentials = credentials("pre")
    dec = PeerLinks("dec", lambda: 7, received.append, credentials("dec"))
    pre = PeerLinks("pre", lambda: 5, lambda frame: None, pre_credentials)
    with structlog.testing.capture_logs() as logs:
        dec_address = await nursery.start(dec.run, "127.0.0.1")
        await nursery.start(pre.run, "127.0.0.1")
        pre.set_address("dec", dec_address)
        pre.send("dec", _cancel("r1"))
        await wait_until(lambda: len(received) == 1, "dec receiving pre's frame")
        assert (received[0].sender, received[0].lease, received[0].message) == ("pre", 5, _cancel("r1"))

        host, _, port = dec_address.rpartition(":")
        forged = msgspec.msgpack.encode(PeerFrame(sender="dec", lease=7, message=_cancel("r2")))
        bare = await trio.open_tcp_stream(host, int(port))  # no credential: a frame where the hello goes
        await bare.send_all(struct.pack(">I", len(forged)) + forged)
        assert await _closed(bare)

        if not tls:  # with TLS an intruder does not get as far as the secret's exchange
            wrong = await trio.open_tcp_stream(host, int(port))
            with pytest.raises(AuthFailed, match="did not prove the cluster secret"):
                await admit_dialer(
                    wrong, Credentials(secret=SECRET[::-1]), purpose="peer", name="x", expect="dec"
                )
            await wrong.aclose()

        stream, sealer = await _connected(dec_address, pre_credentials, "pre")
        claims_enc = msgspec.msgpack.encode(PeerFrame(sender="enc", lease=5, message=_cancel("r3")))
        await stream.send_all(struct.pack(">I", len(claims_enc)) + claims_enc + sealer.seal(claims_enc))
        assert await _closed(stream)

        stream, sealer = await _connected(dec_address, pre_credentials, "pre")
        honest = msgspec.msgpack.encode(PeerFrame(sender="pre", lease=5, message=_cancel("r4")))
        await stream.send_all(struct.pack(">I", len(honest)) + honest + bytes(len(sealer.seal(honest))))
        assert await _closed(stream)  # its MAC is zeros

        stream, _ = await _connected(dec_address, pre_credentials, "pre")
        await stream.send_all(struct.pack(">I", MAX_FRAME_BYTES + 1))
        assert await _closed(stream)

        pre.send("dec", _cancel("r5"))  # the member's own connection served on throughout
        await wait_until(lambda: len(received) == 2, "dec receiving pre's next frame")
    assert [frame.message for frame in received] == [_cancel("r1"), _cancel("r5")]
    refused = [entry for entry in logs if entry["event"] == "cluster.peer_refused"]
    frames = [entry["reason"] for entry in logs if entry["event"] == "cluster.peer_frame_refused"]
    assert len(refused) == (1 if tls else 2)
    assert "claims sender 'enc' on 'pre''s connection" in frames[0]
    assert "fails its MAC" in frames[1]
    assert f"over the {MAX_FRAME_BYTES} limit" in frames[2]


def test_a_node_warns_once_when_others_reach_it_unauthenticated(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("the-cluster-secret-0123456789\n")
    cluster = ["--cluster", "http://127.0.0.1:2379"]
    cases = {
        ("--cluster-host", "10.1.2.3"): 1,
        ("--cluster-host", "127.0.0.1"): 0,
        ("--cluster-host", "10.1.2.3", "--cluster-secret-file", str(secret)): 0,
    }
    for options, warnings in cases.items():
        with structlog.testing.capture_logs() as logs:
            credentials, token = node_credentials(parse_node_config([*cluster, *options]))
        unauthenticated = [entry for entry in logs if entry["event"] == "cluster.unauthenticated"]
        assert len(unauthenticated) == warnings, (options, logs)
        assert token is None and credentials.configured == ("--cluster-secret-file" in options)
    assert "forged frame can stop this node" in unauthenticated_risk(cluster)


def unauthenticated_risk(cluster: list[str]) -> str:
    with structlog.testing.capture_logs() as logs:
        node_credentials(parse_node_config([*cluster, "--cluster-host", "10.1.2.3"]))
    return str(logs[0]["risk"])


@given(chunks=st.lists(st.binary(max_size=64), max_size=8), keyed=st.booleans())
def test_any_bytes_on_a_connection_give_frames_or_a_refusal(chunks: list[bytes], keyed: bool) -> None:
    """Whatever arrives, in whatever pieces: whole frames (their MAC and sender checked), nothing yet, or
    `PeerFrameError` — never another exception, never a frame that failed a check."""
    reader = FrameReader("pre", b"k" * 32 if keyed else None)
    try:
        for chunk in chunks:
            reader.buffer += chunk
            while (frame := reader.next_frame()) is not None:
                assert frame.sender == "pre"
    except PeerFrameError:
        pass


def test_frames_in_pieces_pass_their_checks_in_order() -> None:
    key = b"k" * 32
    sealer, reader = FrameSealer(key, "dialer"), FrameReader("pre", key)
    bodies = [
        msgspec.msgpack.encode(PeerFrame(sender="pre", lease=5, message=_cancel(f"r{i}"))) for i in range(3)
    ]
    wire = b"".join(struct.pack(">I", len(body)) + body + sealer.seal(body) for body in bodies)
    frames = []
    for at in range(0, len(wire), 7):
        reader.buffer += wire[at : at + 7]
        while (frame := reader.next_frame()) is not None:
            frames.append(frame.message)
    assert frames == [_cancel(f"r{i}") for i in range(3)]
