"""etcd with client certificates, on separate network stacks (docs/security.md): etcd serves https and
takes only clients with a certificate of the cluster's CA (`open_host_cluster(..., secure_etcd=True)`).
Two members join through it, serve token-exact across hosts, and one cut off past its lease heals — a
new lease taken over TLS — and serves again; a host without a certificate, or with one of another CA,
reads nothing, and neither does plain http."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import pytest
import trio

from engine.client import ControlClient
from engine.cluster.certificates import make_ca, make_certificate
from engine.hosts.cluster import CLUSTER_NAME, ETCD_HOST, ETCD_PORTS, HostCluster, NodeSpec
from messages.cluster import NodeRecord
from tests.hosts.conftest import host_cluster, serves_token_exact, wait_cluster_serving
from tests.node.harness import wait_idle
from tests.waiting import deadline

# Run on a host of the network: read a key of the cluster from etcd the way the plan says, print the
# outcome as one JSON line ("read" with the value's presence, or "refused" with the error's type).
_READER = """
import base64, json, ssl, sys
import httpx
plan = json.loads(sys.argv[1])
verify = ssl.create_default_context(cafile=plan["ca_file"])
if plan.get("cert_file"):
    verify.load_cert_chain(plan["cert_file"], plan["key_file"])
key = base64.b64encode(plan["key"].encode()).decode()
try:
    with httpx.Client(verify=verify, timeout=5, trust_env=False) as client:
        reply = client.post(plan["url"] + "/v3/kv/range", json={"key": key})
    print(json.dumps({"outcome": "read", "status": reply.status_code, "found": "kvs" in reply.json()}))
except Exception as error:  # the outcome is reported, not raised: the test judges it
    print(json.dumps({"outcome": "refused", "error": type(error).__name__}))
"""


async def _read_from(cluster: HostCluster, host: str, plan: dict[str, str]) -> dict[str, object]:
    with deadline(f"a read of etcd from {host}", 60):
        done = await trio.run_process(
            cluster.network.command(host, [sys.executable, "-c", _READER, json.dumps(plan)]),
            capture_stdout=True,
        )
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


async def _lease_of(cluster: HostCluster, node: str) -> int:
    async with cluster.etcd_client() as etcd:
        stored = await etcd.get(f"/zigzag/{CLUSTER_NAME}/nodes/{node}")
    assert stored is not None, f"no record of {node} in etcd"
    return msgspec.json.decode(stored.value, type=NodeRecord).lease


@pytest.mark.slow
async def test_a_cluster_on_an_etcd_requiring_client_certificates(tmp_path: Path) -> None:
    layout = (
        NodeSpec("pre", "a", "prefill=1,decode=0"),
        NodeSpec("dec", "b", "prefill=0,decode=1"),
    )
    options = ("--transport", "tcp", "--lease-ttl", "3")
    async with host_cluster(tmp_path, layout, *options, secure_etcd=True) as cluster:
        assert cluster.etcd.url.startswith("https://")
        await wait_cluster_serving(cluster, 2)
        await serves_token_exact(cluster, offset=0)

        # Heal: `dec` cut off past its lease; back, it takes a new lease over TLS and serves again.
        lease = await _lease_of(cluster, "dec")
        await cluster.cut("b")
        await cluster.wait_record("dec", present=False, seconds=60)
        await cluster.restore("b")
        await cluster.wait_record("dec", present=True, seconds=60)
        assert await _lease_of(cluster, "dec") != lease
        await wait_cluster_serving(cluster, 2)
        await serves_token_exact(cluster, offset=2)

        # Readers that are not members: from a fresh host, with etcd's CA to trust it by.
        await trio.to_thread.run_sync(cluster.network.add, "x")
        assert cluster.etcd.client_tls is not None and cluster.etcd.client_tls.ca_file is not None
        url = cluster.etcd.url
        key = f"/zigzag/{CLUSTER_NAME}/nodes/pre"
        ca_file = cluster.etcd.client_tls.ca_file
        foreign = make_certificate(tmp_path / "foreign", make_ca(tmp_path / "foreign", "foreign-ca"), "x")
        assert cluster.ca is not None
        member_like = make_certificate(tmp_path / "reader", cluster.ca, "x-reader")
        no_certificate = await _read_from(cluster, "x", {"url": url, "key": key, "ca_file": ca_file})
        other_ca = await _read_from(
            cluster,
            "x",
            {
                "url": url,
                "key": key,
                "ca_file": ca_file,
                "cert_file": str(foreign.cert_file),
                "key_file": str(foreign.key_file),
            },
        )
        plain = f"http://{cluster.network.address(ETCD_HOST)}:{ETCD_PORTS[0]}"
        over_http = await _read_from(cluster, "x", {"url": plain, "key": key, "ca_file": ca_file})
        assert no_certificate["outcome"] == other_ca["outcome"] == over_http["outcome"] == "refused", (
            no_certificate,
            other_ca,
            over_http,
        )
        # The same reader with a certificate of the cluster's CA reads the record: the refusals above
        # are the certificates', not the network's.
        signed = await _read_from(
            cluster,
            "x",
            {
                "url": url,
                "key": key,
                "ca_file": ca_file,
                "cert_file": str(member_like.cert_file),
                "key_file": str(member_like.key_file),
            },
        )
        assert signed == {"outcome": "read", "status": 200, "found": True}, signed

        for node in ("pre", "dec"):
            address = cluster.nodes[node].address
            assert address is not None
            async with ControlClient.connect(address, token=cluster.token) as client:
                await wait_idle(client)
