"""etcd with user/password authentication, on separate network stacks (docs/security.md): etcd requires a
user for every key (`open_host_cluster(..., etcd_auth=True)`); the members join as a user that reads and
writes only the cluster's keys, its password given in their environment. They serve token-exact across
hosts; a host that asks without a user, or with a wrong password, reads nothing. etcd restarted while a
member is cut off ends every token it handed out: the member, back, authenticates again, takes a new lease
and serves again."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import pytest
import trio

from engine.client import ControlClient
from engine.hosts.cluster import CLUSTER_NAME, HostCluster, NodeSpec
from messages.cluster import NodeRecord
from tests.hosts.conftest import host_cluster, serves_token_exact, wait_cluster_serving
from tests.node.harness import wait_idle
from tests.waiting import deadline

# Run on a host of the network: authenticate as the plan says (or not at all), read a key of the cluster,
# print the outcome as one JSON line: "read" with the value's presence, or "refused" with etcd's answer.
_READER = """
import base64, json, sys
import httpx
plan = json.loads(sys.argv[1])
key = base64.b64encode(plan["key"].encode()).decode()
with httpx.Client(timeout=5, trust_env=False) as client:
    headers = {}
    if "user" in plan:
        login = client.post(plan["url"] + "/v3/auth/authenticate",
                            json={"name": plan["user"], "password": plan["password"]})
        if login.status_code != 200:
            print(json.dumps({"outcome": "refused", "call": "authenticate", "message": login.json()["message"]}))
            sys.exit()
        headers["Authorization"] = login.json()["token"]
    reply = client.post(plan["url"] + "/v3/kv/range", json={"key": key}, headers=headers)
if reply.status_code != 200:
    print(json.dumps({"outcome": "refused", "call": "range", "message": reply.json()["message"]}))
else:
    print(json.dumps({"outcome": "read", "found": "kvs" in reply.json()}))
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
async def test_a_cluster_on_an_etcd_requiring_a_user_and_password(tmp_path: Path) -> None:
    layout = (
        NodeSpec("pre", "a", "prefill=1,decode=0"),
        NodeSpec("dec", "b", "prefill=0,decode=1"),
    )
    options = ("--transport", "tcp", "--lease-ttl", "3")
    async with host_cluster(tmp_path, layout, *options, etcd_auth=True) as cluster:
        auth = cluster.etcd.auth
        assert auth is not None
        for host_node in cluster.nodes.values():  # the password travels in the environment only
            assert auth.password not in " ".join(host_node.options)
        await wait_cluster_serving(cluster, 2)
        await serves_token_exact(cluster, offset=0)

        # Readers that are not members, from a fresh host.
        await trio.to_thread.run_sync(cluster.network.add, "x")
        plan = {"url": cluster.etcd.url, "key": f"/zigzag/{CLUSTER_NAME}/nodes/pre"}
        anonymous = await _read_from(cluster, "x", plan)
        assert anonymous == {
            "outcome": "refused",
            "call": "range",
            "message": "etcdserver: user name is empty",
        }, anonymous
        wrong = await _read_from(cluster, "x", plan | {"user": auth.user, "password": auth.password + "x"})
        assert wrong == {
            "outcome": "refused",
            "call": "authenticate",
            "message": "etcdserver: authentication failed, invalid user ID or password",
        }, wrong
        # The same reader with the members' password reads the record: the refusals above are the
        # credentials', not the network's.
        member = await _read_from(cluster, "x", plan | {"user": auth.user, "password": auth.password})
        assert member == {"outcome": "read", "found": True}, member

        # etcd restarted while `dec` is cut off: the tokens it handed out end with it (etcd keeps them in
        # memory). `dec`, back past its lease, is refused with its old token: it takes a new lease and
        # writes its record only by authenticating again.
        lease = await _lease_of(cluster, "dec")
        await cluster.cut("b")
        await cluster.restart_etcd()
        await cluster.wait_record("dec", present=False, seconds=60)
        await cluster.restore("b")
        await cluster.wait_record("dec", present=True, seconds=60)
        assert await _lease_of(cluster, "dec") != lease
        await wait_cluster_serving(cluster, 2)
        await serves_token_exact(cluster, offset=2)

        for node in ("pre", "dec"):
            address = cluster.nodes[node].address
            assert address is not None
            async with ControlClient.connect(address, token=cluster.token) as client:
                await wait_idle(client)
