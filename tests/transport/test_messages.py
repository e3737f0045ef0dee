"""Every transfer protocol message round-trips through msgpack (peer codec) and JSON."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from messages.layout import BufferSpec, PoolLayout
from messages.peer_codec import (
    NO_HEADER,
    PeerCodecError,
    decode_header,
    decode_peer,
    encode_header,
    encode_peer,
)
from messages.transfer import (
    Abort,
    AbortAck,
    ChunkDone,
    FailureReason,
    Grant,
    Heartbeat,
    Hello,
    HelloAck,
    PeerMessage,
    Refusal,
    RequestMoreCache,
    StatusUpdate,
    TotalAnnounce,
    TransferReport,
    TransferStatus,
)

Codec = Callable[[object], bytes]
counts = st.integers(0, 2**40)
names = st.text(min_size=1, max_size=12)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=8,
)
layouts = st.builds(
    PoolLayout,
    block_size=st.integers(1, 512),
    buffers=st.lists(
        st.builds(
            BufferSpec,
            name=names,
            shape=st.lists(st.integers(1, 64), max_size=3).map(tuple),
            dtype=st.sampled_from(["float32", "float16", "bfloat16", "int64", "int32", "uint8"]),
        ),
        max_size=3,
    ).map(tuple),
)
block_lists = st.lists(st.integers(0, 2**20), max_size=8).map(tuple)
buffer_selection = st.none() | st.lists(names, max_size=3).map(tuple)


def messages(encode: Codec) -> st.SearchStrategy[PeerMessage]:
    headers = json_values.map(lambda value: msgspec.Raw(encode(value)))
    return st.one_of(
        st.builds(
            Hello,
            link_id=names,
            protocol_version=st.integers(0, 9),
            endpoint=names,
            layout=layouts,
            address=st.text(max_size=20),
        ),
        st.builds(HelloAck, link_id=names, endpoint=names),
        st.builds(Refusal, link_id=names, reason=st.text(max_size=40)),
        st.builds(Heartbeat, link_id=names, seq=counts),
        st.builds(
            Grant,
            transfer_id=names,
            round=counts,
            landing_key=counts,
            stream_offset=counts,
            tokens=counts,
            blocks=block_lists,
            header=headers,
            landing_offset=counts,
            buffers=buffer_selection,
            expected_tokens=st.none() | counts,
        ),
        st.builds(
            RequestMoreCache,
            transfer_id=names,
            round=counts,
            stream_offset=counts,
            tokens=counts,
            blocks=block_lists,
            landing_offset=counts,
        ),
        st.builds(TotalAnnounce, transfer_id=names, total_tokens=counts, header=headers),
        st.builds(
            ChunkDone,
            transfer_id=names,
            round=counts,
            offset=counts,
            tokens=counts,
            total_tokens=counts,
            header=headers,
            checksum=st.none() | st.integers(0, 2**32 - 1),
        ),
        st.builds(
            Abort,
            transfer_id=names,
            reason=st.sampled_from(FailureReason),
            detail=st.text(max_size=30),
            round=st.none() | counts,
        ),
        st.builds(AbortAck, transfer_id=names),
        st.builds(
            StatusUpdate,
            transfer_id=names,
            status=st.sampled_from(TransferStatus),
            detail=st.text(max_size=20),
        ),
    )


@settings(max_examples=300, deadline=None)
@given(message=messages(msgspec.msgpack.encode))
def test_every_message_round_trips_through_the_peer_codec(message: PeerMessage) -> None:
    assert decode_peer(encode_peer(message)) == message


@settings(max_examples=300, deadline=None)
@given(message=messages(msgspec.json.encode))
def test_every_message_round_trips_through_json(message: PeerMessage) -> None:
    assert msgspec.json.decode(msgspec.json.encode(message), type=PeerMessage) == message


@settings(max_examples=50, deadline=None)
@given(
    report=st.builds(
        TransferReport,
        transfer_id=names,
        role=st.sampled_from(["sender", "receiver"]),
        peer=names,
        status=st.sampled_from(TransferStatus),
        rounds=counts,
        grants=counts,
        tokens=counts,
        bytes=counts,
        seconds=st.floats(0, 1e6),
        started_at=st.floats(0, 2e9),
        ended_at=st.floats(0, 2e9),
        reason=st.none() | st.sampled_from(FailureReason),
        detail=st.text(max_size=20),
    )
)
def test_transfer_report_round_trips(report: TransferReport) -> None:
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(report), type=TransferReport) == report
    assert msgspec.json.decode(msgspec.json.encode(report), type=TransferReport) == report


def test_header_helpers() -> None:
    assert decode_header(encode_header({"request_id": "r1", "grid": [1, 2, 3]}), dict) == {
        "request_id": "r1",
        "grid": [1, 2, 3],
    }
    assert decode_header(NO_HEADER, type(None)) is None
    with pytest.raises(PeerCodecError, match=r"transfer header is not a valid int"):
        decode_header(encode_header("text"), int)


def test_malformed_frames_are_refused_with_the_reason() -> None:
    with pytest.raises(PeerCodecError, match=r"malformed control frame \(3 bytes\)"):
        decode_peer(b"\x93\x01\x02")
    truncated = msgspec.msgpack.encode({"type": "abort_ack", "transfer_id": "t"})[:-1]
    with pytest.raises(
        PeerCodecError, match=r"malformed control frame \(\d+ bytes\): Input data was truncated"
    ):
        decode_peer(truncated)
    bad_round = msgspec.msgpack.encode(
        {
            "type": "request_more_cache",
            "transfer_id": "t",
            "round": -1,
            "stream_offset": 0,
            "tokens": 1,
            "blocks": [],
        }
    )
    with pytest.raises(
        PeerCodecError, match=r"^malformed control frame \(77 bytes\): Expected `int` >= 0 - at `\$.round`$"
    ):
        decode_peer(bad_round)
    unknown = msgspec.msgpack.encode({"type": "abort_ack", "transfer_id": "t", "extra": 1})
    with pytest.raises(PeerCodecError, match=r"unknown field `extra`"):
        decode_peer(unknown)
