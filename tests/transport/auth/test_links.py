"""Transfer links admitted by the cluster secret (TransferConfig.admission), over tcp and ucx: endpoints
that share it move bytes exactly as before; a receiver without it, or with another, is refused before
any grant — its connect fails naming why, the sender logs `transfer.link_refused` — and the sender goes
on serving the members."""

from __future__ import annotations

import msgspec
import pytest
import structlog.testing
import trio

from tests.transport.harness import (
    Collector,
    Source,
    assert_same_bytes,
    embedding_layout,
    listen,
    random_storage,
    send_all,
    shuffled_pool,
)
from tests.waiting import WAIT_SECONDS
from transport.auth.credentials import LinkAdmission
from transport.config import TransferConfig
from transport.endpoint import TransferEndpoint, open_endpoint
from transport.errors import LinkError

SECRET = b"transfer-secret-0123456789abcdef"
MEMBER = TransferConfig(admission=LinkAdmission("pre", SECRET), handshake_timeout=5.0)


async def _receive_from(
    sender: TransferEndpoint, address: str, source: Source, config: TransferConfig, transfer_id: str
) -> None:
    layout = source.storage.layout
    storage, pool = random_storage(layout, 20, seed=5), shuffled_pool(20, layout.block_size, seed=6)
    async with open_endpoint("dec/emb", storage, pool, config=config) as receiver:
        link = await receiver.connect(address)
        collector = Collector()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_all, sender, transfer_id, source)
            await receiver.receive(transfer_id, peer=link, consume=collector)
    assert_same_bytes(collector.data(), source.expected(tokens=source.tokens))
    assert pool.used_blocks == 0


@pytest.mark.parametrize("kind", ["tcp", "ucx"])
async def test_members_link_and_others_are_refused_before_any_grant(
    kind: str, request: pytest.FixtureRequest
) -> None:
    if kind == "ucx":
        request.getfixturevalue("ucx_env")
    layout = embedding_layout(block_size=16)
    source = Source(layout, 100, seed=3)
    intruders = {
        "no secret": msgspec.structs.replace(MEMBER, admission=None),
        "another secret": msgspec.structs.replace(MEMBER, admission=LinkAdmission("x", SECRET[::-1])),
    }
    with trio.fail_after(WAIT_SECONDS), structlog.testing.capture_logs() as logs:
        async with open_endpoint("pre/emb", source.storage, source.pool, config=MEMBER) as sender:
            address = await listen(sender, kind)
            await _receive_from(sender, address, source, MEMBER, "t1")
            for config in intruders.values():
                storage, pool = random_storage(layout, 4, seed=7), shuffled_pool(4, 16, seed=8)
                async with open_endpoint("x/emb", storage, pool, config=config) as intruder:
                    with pytest.raises(LinkError):
                        await intruder.connect(address)
                assert sender.links() == [link for link in sender.links() if link.peer == "dec/emb"]
            await _receive_from(sender, address, source, MEMBER, "t2")  # the members' links still work
    refused = [entry for entry in logs if entry["event"] == "transfer.link_refused"]
    assert len(refused) == 2, logs
    reasons = [entry["reason"] for entry in refused]
    # no secret: it began with its own bytes (tcp: its hello frame; ucx: its first control body)
    assert "did not open with this cluster's authentication" in reasons[0] or "unknown kind" in reasons[0]
    assert "closed the link" in reasons[1]  # another: it found the sender's MAC wrong
