"""A host cut off for longer than the lease TTL, on separate network stacks: its node loses its lease,
the others end what they shared with it; once its link is back it rejoins under a new lease with the
same replicas, and the cluster places KV across hosts again (token-exact), with no block held after.
Once for the prefill host, once for the decode host with streams in flight."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from engine.client import ControlClient, ControlError
from engine.hosts.cluster import HostCluster, NodeSpec
from messages.control_replies import TokenReply
from replicas.model import tiny_model
from tests.hosts.conftest import host_cluster, wait_cluster_serving
from tests.node.harness import wait_idle, wait_status
from tests.node.workload import Ask, assert_correct, distinct_asks, send
from tests.waiting import wait_until

LEASE_TTL = 2
LAYOUT = (NodeSpec("pre", "a", "prefill=1,decode=0"), NodeSpec("dec", "b", "prefill=0,decode=1"))


@pytest.mark.slow
async def test_a_prefill_host_cut_off_rejoins_and_places_kv_again(tmp_path: Path) -> None:
    model = tiny_model()
    options = ("--transport", "tcp", "--lease-ttl", str(LEASE_TTL))
    async with host_cluster(tmp_path, LAYOUT, *options) as cluster:
        await wait_cluster_serving(cluster, 2)
        pre, dec = cluster.nodes["pre"].address, cluster.nodes["dec"].address
        assert pre is not None and dec is not None
        assert pre.startswith(cluster.network.address("a")) and dec.startswith(cluster.network.address("b"))
        async with ControlClient.connect(pre, token=cluster.token) as client:
            status = await client.status()
            assert status.cluster is not None
            lease = status.cluster.lease
            before = await send(client, distinct_asks(1, max_tokens=4)[0])
            assert_correct(model, [before])

        await cluster.cut("a")
        async with ControlClient.connect(dec, token=cluster.token) as client:
            await wait_status(
                client,
                lambda s: s.cluster is not None and "pre" not in s.cluster.nodes,
                "dec seeing pre leave once its lease ended",
                timeout=30,
            )
        await cluster.restore("a")
        await _rejoined_and_serving(cluster, "pre", lease, distinct_asks(3, max_tokens=5, offset=1))


@pytest.mark.slow
async def test_a_decode_host_cut_off_mid_stream_ends_its_requests_with_codes_and_rejoins(
    tmp_path: Path,
) -> None:
    """Streams in flight from host b's decode replica when b's link is cut: each ends, within the lease
    TTL and the time to notice it, with an error code a client can act on (not a hang, not `internal`);
    pre holds no block; once the link is back, dec rejoins under a new lease and serves token-exact.

    A request whose KV reservation dec granted but whose answer the cut stopped was never held by dec in
    pre's books: it waits for a decode replica to take it, as a prefilled request does, and with none left
    fails `overloaded` at `--migration-wait` (10 s here)."""
    # Decode steps slowed to 10 a second, so that 200 tokens stream for 20 s: the cut falls mid-stream.
    options = (
        "--transport",
        "tcp",
        "--lease-ttl",
        str(LEASE_TTL),
        "--emulated-speed",
        "decode_steps_per_s=10",
        "--migration-wait",
        "10",
    )
    async with host_cluster(tmp_path, LAYOUT, *options) as cluster:
        await wait_cluster_serving(cluster, 2)
        pre, dec = cluster.nodes["pre"].address, cluster.nodes["dec"].address
        assert pre is not None and dec is not None
        async with ControlClient.connect(dec, token=cluster.token) as client:
            status = await client.status()
            assert status.cluster is not None
            lease = status.cluster.lease

        asks = distinct_asks(3, max_tokens=200)
        streamed = [0] * len(asks)
        ended: dict[int, str] = {}

        async def stream(index: int) -> None:
            ask = asks[index]
            try:
                async with ControlClient.connect(pre, token=cluster.token) as client:
                    async for reply in client.generate(
                        input_ids=ask.input_ids, max_tokens=ask.max_tokens, ignore_eos=True, stream=True
                    ):
                        if isinstance(reply, TokenReply):
                            streamed[index] += 1
                        else:
                            ended[index] = "finished"
            except ControlError as error:
                assert error.code not in ("internal", "shutting_down") and error.message, error
                ended[index] = error.code

        async with trio.open_nursery() as nursery:
            for index in range(len(asks)):
                nursery.start_soon(stream, index)
            await wait_until(lambda: all(streamed), "every request streaming from dec/decode-0", 30)
            assert not ended, ended
            await cluster.cut("b")
            await wait_until(
                lambda: len(ended) == len(asks),
                "every request ending once dec's lease ran out",
                LEASE_TTL + 30,
                detail=lambda: ended,
            )
        assert set(ended.values()) <= {"replica_failed", "transfer_failed", "overloaded"}, ended
        assert all(0 < count < 200 for count in streamed), streamed
        async with ControlClient.connect(pre, token=cluster.token) as client:
            await wait_idle(client)

        await cluster.restore("b")
        await _rejoined_and_serving(cluster, "dec", lease, distinct_asks(2, max_tokens=5, offset=7))


@pytest.mark.slow
async def test_work_accepted_under_a_lost_lease_ends_with_it(tmp_path: Path) -> None:
    """Prompts that dec admitted queue on pre's prefill replica (slowed to 300 tokens a second) when
    pre's link is cut: dec ends them with codes once pre's lease runs out; pre, back, ends what it
    accepted under the lost lease at once — nothing of it is prefilled after the loss — takes a new
    lease, holds no block and serves token-exact."""
    options = (
        *("--transport", "tcp", "--lease-ttl", str(LEASE_TTL)),
        *("--emulated-speed", "prefill_tokens_per_s=40"),
    )
    async with host_cluster(tmp_path, LAYOUT, *options) as cluster:
        await wait_cluster_serving(cluster, 2)
        pre, dec = cluster.nodes["pre"].address, cluster.nodes["dec"].address
        assert pre is not None and dec is not None
        async with ControlClient.connect(pre, token=cluster.token) as client:
            status = await client.status()
            assert status.cluster is not None
            lease = status.cluster.lease

        asks = distinct_asks(8, max_tokens=4, offset=20)
        ended: dict[int, str] = {}

        async def ask(index: int) -> None:
            try:
                async with ControlClient.connect(dec, token=cluster.token) as client:
                    await send(client, asks[index])
                ended[index] = "finished"
            except ControlError as error:
                assert error.code not in ("internal", "shutting_down") and error.message, error
                ended[index] = error.code

        def events(name: str) -> list[dict[str, object]]:
            lines = cluster.nodes["pre"].log_files[-1].read_text().splitlines()
            return [e for e in map(json.loads, lines) if e.get("event") == name]

        async with trio.open_nursery() as nursery:
            for index in range(len(asks)):
                nursery.start_soon(ask, index)
            await wait_until(lambda: events("prefill_started"), "pre prefilling dec's prompts", 30)
            await cluster.cut("a")
            await wait_until(
                lambda: len(ended) == len(asks),
                "every request ending once pre's lease ran out",
                LEASE_TTL + 30,
                detail=lambda: ended,
            )
        assert set(ended.values()) <= {"finished", "replica_failed", "transfer_failed"}, ended

        await cluster.restore("a")
        await _rejoined_and_serving(cluster, "pre", lease, distinct_asks(2, max_tokens=5, offset=40))
        lost = [
            e["ts"]
            for e in events("diagnostic")
            if e["name"] == "cluster.lease_lost"  # type: ignore[index]
        ]
        assert lost, "pre never noticed it lost its lease"
        ids = {e["request_id"] for e in events("request_arrived")}
        late = [e for e in events("prefill_started") if e["ts"] > lost[0] and e["request_id"] not in ids]  # type: ignore[operator]
        assert not late, f"prefilled for an origin that ended the request: {late}"


async def _rejoined_and_serving(cluster: HostCluster, node_id: str, lease: int, asks: list[Ask]) -> None:
    """Once its link is back: `node_id` holds a lease other than `lease`, both nodes serve, `asks` sent to
    pre come back token-exact with their KV moved from pre's prefill replica to dec's decode replica, and
    neither node holds a block."""
    pre, rejoined = cluster.nodes["pre"].address, cluster.nodes[node_id].address
    assert pre is not None and rejoined is not None
    async with ControlClient.connect(rejoined, token=cluster.token) as client:
        await wait_status(
            client,
            lambda s: s.cluster is not None and s.cluster.state == "ok" and s.cluster.lease != lease,
            f"{node_id} back under a new lease",
            timeout=60,
        )
    await wait_cluster_serving(cluster, 2)
    async with ControlClient.connect(pre, token=cluster.token) as client:
        outcomes = [await send(client, ask) for ask in asks]
        assert_correct(tiny_model(), outcomes)
        for outcome in outcomes:
            assert [(t.source, t.destination) for t in outcome.result.transfers] == [
                ("pre/prefill-0", "dec/decode-0")
            ]
    for node in ("pre", "dec"):
        address = cluster.nodes[node].address
        assert address is not None
        async with ControlClient.connect(address, token=cluster.token) as client:
            await wait_idle(client)
