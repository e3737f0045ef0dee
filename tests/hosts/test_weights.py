"""Weights from any node, on separate network stacks: a node that joined holding no replica and no
weights is filled by `scale … node=`, its replica copying from a replica of another host over the
transfer links between their `--cluster-host` addresses, and serves token-exact. The source node killed
mid-copy: a copy asked for `auto` goes on from the next source at the layer it reached, one asked for
`peer` fails with a message that names the peer, its node and the piece; no block stays held."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.client import ControlClient
from engine.hosts.cluster import HostCluster, NodeSpec
from replicas.model import tiny_model
from tests.hosts.conftest import host_cluster, wait_cluster_serving
from tests.node.harness import wait_idle, wait_status
from tests.node.workload import assert_correct, distinct_asks, send
from tests.waiting import wait_until

LEASE_TTL = 2
# `cap` joins empty. `pa` and `pb` hold the model (their replicas share a resident copy); a copy reads
# from the first peer by name, pa/decode-0, and pb's replicas are the next sources.
LAYOUT = (
    NodeSpec("pa", "a", "prefill=0,decode=1"),
    NodeSpec("pb", "b", "prefill=1,decode=1"),
    NodeSpec("cap", "c", "prefill=0,decode=0"),
)
# cap's first two copies wait before layer 1 until released.
HOLDS = (
    *("--fault", "hold_weights:before_layer=1,seconds=120,nth=1"),
    *("--fault", "hold_weights:before_layer=1,seconds=120,nth=2"),
)


def _events(cluster: HostCluster, node: str, kind: str) -> list[dict[str, object]]:
    found = []
    for path in cluster.nodes[node].log_files:
        if path.exists():
            found += [e for line in path.read_text().splitlines() if (e := json.loads(line))["event"] == kind]
    return found


def _of(events: list[dict[str, object]], replica: str) -> dict[str, object]:
    return next(e for e in events if e["replica"] == replica)


@pytest.mark.slow
async def test_an_empty_node_copies_weights_from_another_host_and_outlives_its_source(tmp_path: Path) -> None:
    model = tiny_model()
    options = ("--transport", "tcp", "--lease-ttl", str(LEASE_TTL), *HOLDS)
    async with host_cluster(tmp_path, LAYOUT, *options) as cluster:
        await wait_cluster_serving(cluster, 3)
        cap, pb = cluster.nodes["cap"].address, cluster.nodes["pb"].address
        host_a = cluster.network.address("a")
        assert cap is not None and pb is not None
        async with ControlClient.connect(cap, token=cluster.token) as client:
            assert not [r for r in (await client.status()).replicas if r.node == "cap"]

        # Two copies into cap from host a, both held before layer 1; the scale ops, sent to pb, run on
        # cap. pa dies meanwhile.
        async with ControlClient.connect(pb, token=cluster.token) as client:
            result = await client.scale("prefill", 1, node="cap", source="auto")
            assert [(s.replica, s.source) for s in result.started] == [("cap/prefill-0", "peer")]
            await client.scale("decode", 1, node="cap", source="peer")
        await wait_until(
            lambda: len(_events(cluster, "cap", "fault_injected")) == 2, "both copies held before layer 1"
        )
        held = _events(cluster, "cap", "weights_copy_started")
        auto, explicit = _of(held, "cap/prefill-0"), _of(held, "cap/decode-0")
        assert auto["peers"] == ["pa/decode-0", "pb/decode-0", "pb/prefill-0"], auto
        assert auto["sources"] == ["peer", "peer", "peer", "disk"], auto
        assert auto["reason"] == (
            f"replica pa/decode-0 (node pa at {host_a}) holds the whole model and no replica of this node "
            "or this host does"
        ), auto
        assert explicit["peers"] == ["pa/decode-0"], explicit
        assert explicit["reason"] == f"asked for replica pa/decode-0 (node pa at {host_a})", explicit
        await cluster.kill("pa")
        async with ControlClient.connect(cap, token=cluster.token) as client:
            await client.release()
            status = await wait_status(
                client,
                lambda s: (
                    {(r.name, r.state) for r in s.replicas}
                    >= {("cap/prefill-0", "Prefill"), ("cap/decode-0", "Inactive")}
                ),
                "cap/prefill-0 loaded on from pb, cap/decode-0 failed",
                timeout=60,
            )
            mine = next(r for r in status.replicas if r.name == "cap/prefill-0")
            assert mine.weights_source == "peer" and mine.loaded_layers == mine.total_layers
            failed = next(r for r in status.replicas if r.name == "cap/decode-0")
            assert failed.last_error is not None and failed.last_error.startswith(
                "WeightCopyFailed: cap/decode-0: copying the weights of tiny from peer replica pa/decode-0 "
                "(node pa) failed at layer 1: "
            ), failed.last_error
            finished = {e["replica"]: e for e in _events(cluster, "cap", "weights_copy_finished")}
            assert finished["cap/prefill-0"]["status"] == "success", finished
            assert finished["cap/prefill-0"]["weights_source"] == "peer"
            fallbacks = finished["cap/prefill-0"]["fallbacks"]
            assert isinstance(fallbacks, list)
            assert [(f["weights_source"], f["piece"]) for f in fallbacks] == [("peer", "layer 1")], fallbacks
            assert str(fallbacks[0]["reason"]).startswith("pa/decode-0: "), fallbacks
            assert finished["cap/decode-0"]["status"] == "failed", finished

            # cap serves with its own prefill replica and pb's decode one, token-exact.
            outcomes = [await send(client, ask) for ask in distinct_asks(3, max_tokens=5)]
            assert_correct(model, outcomes)
            for outcome in outcomes:
                assert [(t.source, t.destination) for t in outcome.result.transfers] == [
                    ("cap/prefill-0", "pb/decode-0")
                ]
            # Now a replica of cap holds the model: `auto` reads within the node.
            await client.transition("cap/decode-0", "LoadingDecode", source="auto")
            await wait_status(
                client,
                lambda s: any(r.name == "cap/decode-0" and r.state == "Decode" for r in s.replicas),
                "cap/decode-0 loaded within its node",
            )
            again = [
                e for e in _events(cluster, "cap", "weights_copy_started") if e["replica"] == "cap/decode-0"
            ]
            assert again[-1]["reason"] == (
                "replica cap/prefill-0 (this node) holds the whole model: a copy within the node's memory"
            ), again[-1]
        for address in (cap, pb):
            async with ControlClient.connect(address, token=cluster.token) as client:
                await wait_idle(client, nodes={"cap", "pb"})
