"""A host cut off for longer than the lease TTL, on separate network stacks: its node loses its lease,
the others end what they shared with it; once its link is back it rejoins under a new lease with the
same replicas, and the cluster places KV across hosts again (token-exact), with no block held after."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.client import ControlClient
from engine.hosts.cluster import NodeSpec
from replicas.model import tiny_model
from tests.hosts.conftest import host_cluster, wait_cluster_serving
from tests.node.harness import wait_idle, wait_status
from tests.node.workload import assert_correct, distinct_asks, send

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

        async with ControlClient.connect(pre, token=cluster.token) as client:
            await wait_status(
                client,
                lambda s: s.cluster is not None and s.cluster.state == "ok" and s.cluster.lease != lease,
                "pre back under a new lease",
                timeout=60,
            )
        await wait_cluster_serving(cluster, 2)
        async with ControlClient.connect(pre, token=cluster.token) as client:
            outcomes = [await send(client, ask) for ask in distinct_asks(3, max_tokens=5, offset=1)]
            assert_correct(model, outcomes)
            for outcome in outcomes:
                assert [(t.source, t.destination) for t in outcome.result.transfers] == [
                    ("pre/prefill-0", "dec/decode-0")
                ]
        for address in (pre, dec):
            async with ControlClient.connect(address, token=cluster.token) as client:
                await wait_idle(client)
