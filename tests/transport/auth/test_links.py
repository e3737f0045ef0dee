"""Transfer links admitted by the cluster secret (TransferConfig.admission), over tcp and ucx: endpoints
that share it move bytes exactly as before; a receiver without it, or with another, is refused before
any grant — its connect fails naming why, the sender logs `transfer.link_refused` — and the sender goes
on serving the members."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import structlog.testing
import trio

from tests.certs import make_ca, make_node_cert
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
from tests.waiting import WAIT_SECONDS, deadline
from transport.auth.credentials import Credentials, LinkAdmission
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
    with deadline("the transfers and the refusals", WAIT_SECONDS), structlog.testing.capture_logs() as logs:
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


async def test_tls_links_carry_the_same_bytes_and_refuse_a_foreign_certificate(tmp_path: Path) -> None:
    """`--transfer-tls`: after the secret, a TLS handshake (both certificates checked against the CA);
    every round's bytes then travel encrypted and land exactly; a receiver whose certificate another CA
    signed is refused before any grant."""
    ca, foreign_ca = make_ca(tmp_path / "ca"), make_ca(tmp_path / "foreign", "foreign-ca")

    def config(node: str, authority: tuple[Path, Path], directory: Path) -> TransferConfig:
        credentials = Credentials(secret=SECRET, tls=make_node_cert(directory, authority, node))
        return msgspec.structs.replace(
            MEMBER, admission=credentials.admission(node, tls=True), round_cap_blocks=2
        )

    layout = embedding_layout(block_size=16)
    source = Source(layout, 100, seed=3)
    with deadline("the transfers and the refusals", WAIT_SECONDS), structlog.testing.capture_logs() as logs:
        async with open_endpoint(
            "pre/emb", source.storage, source.pool, config=config("pre", ca, tmp_path)
        ) as sender:
            address = await sender.listen_tcp()
            await _receive_from(sender, address, source, config("dec", ca, tmp_path), "t1")  # 4 rounds
            storage, pool = random_storage(layout, 4, seed=7), shuffled_pool(4, 16, seed=8)
            intruder = config("dec", foreign_ca, tmp_path / "foreign")
            async with open_endpoint("x/emb", storage, pool, config=intruder) as endpoint:
                with pytest.raises(LinkError):
                    await endpoint.connect(address)
            await _receive_from(sender, address, source, config("dec", ca, tmp_path), "t2")
    refused = [entry["reason"] for entry in logs if entry["event"] == "transfer.link_refused"]
    assert len(refused) == 1 and "TLS handshake" in refused[0], refused
