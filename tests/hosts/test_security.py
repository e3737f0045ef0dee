"""Only members speak to members (docs/security.md), on separate network stacks: two members with the
cluster secret and certificates of its CA serve token-exact across hosts over authenticated peer links
and transfer links that speak TLS (`--transfer-tls`); a node with a wrong secret joins etcd but no member takes its links; a fifth host that
never joined forges peer frames (shutdown, generate, cancel, lock, report) as another member under its
lease — read from etcd, as anyone on the network can — announces a 600 MiB frame, offers a certificate of
another CA and dials the transfer endpoints: each connection is closed unserved and logged, and the
cluster serves on, token-exact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import trio

from engine.client import ControlClient
from engine.cluster.etcd import Etcd
from engine.hosts.cluster import CLUSTER_NAME, HostCluster, NodeSpec
from messages.cluster import NodeRecord
from tests.certs import make_ca, make_node_cert
from tests.hosts.conftest import host_cluster, serves_token_exact, wait_cluster_serving
from tests.node.harness import wait_idle
from tests.waiting import deadline

REPO = Path(__file__).resolve().parents[2]


def _credentials(directory: Path, ca: tuple[Path, Path], node: str, secret: Path) -> tuple[str, ...]:
    tls = make_node_cert(directory, ca, node)
    return (
        *("--cluster-secret-file", str(secret), "--peer-ca-file", tls.ca_file),
        *("--peer-cert-file", tls.cert_file, "--peer-key-file", tls.key_file),
    )


async def _record(cluster: HostCluster, node: str) -> NodeRecord:
    async with Etcd(cluster.etcd.url, timeout=2.0) as etcd:
        stored = await etcd.get(f"/zigzag/{CLUSTER_NAME}/nodes/{node}")
    assert stored is not None, f"no record of {node} in etcd"
    return msgspec.json.decode(stored.value, type=NodeRecord)


def _listening_ports(cluster: HostCluster, host: str) -> set[int]:
    listed = subprocess.run(
        cluster.network.command(host, ["ss", "-ltnH"]), capture_output=True, text=True, check=True, timeout=30
    ).stdout
    return {int(line.split()[3].rpartition(":")[2]) for line in listed.splitlines() if line.strip()}


def _diagnostics(cluster: HostCluster, node: str, name: str) -> list[dict[str, str]]:
    """The fields of `node`'s diagnostics named `name`, from its event log (docs/logging.md)."""
    lines = cluster.nodes[node].log_files[-1].read_text().splitlines()
    entries = [json.loads(line) for line in lines]
    return [
        entry["fields"] for entry in entries if entry.get("event") == "diagnostic" and entry["name"] == name
    ]


def _stopped(cluster: HostCluster, node: str) -> bool:
    lines = cluster.nodes[node].log_files[-1].read_text().splitlines()
    return any(json.loads(line).get("event") == "node_stopping" for line in lines)


@pytest.mark.slow
async def test_a_host_that_never_joined_and_a_member_with_a_wrong_secret_are_refused(tmp_path: Path) -> None:
    secret, wrong = tmp_path / "secret", tmp_path / "wrong-secret"
    secret.write_text("the-cluster-secret-0123456789abcdef\n")
    wrong.write_text("not-the-cluster-secret-0123456789\n")
    ca, foreign_ca = make_ca(tmp_path / "ca"), make_ca(tmp_path / "foreign", "foreign-ca")
    foreign = make_node_cert(tmp_path / "foreign", foreign_ca, "dec")  # names a member, signed elsewhere
    layout = (
        NodeSpec("pre", "a", "prefill=1,decode=0", _credentials(tmp_path, ca, "pre", secret)),
        NodeSpec("dec", "b", "prefill=0,decode=1", _credentials(tmp_path, ca, "dec", secret)),
        NodeSpec("bad", "c", "prefill=0,decode=1", _credentials(tmp_path, ca, "bad", wrong)),
    )
    async with host_cluster(tmp_path, layout, "--transport", "tcp", "--transfer-tls") as cluster:
        await wait_cluster_serving(cluster, 2, nodes=["pre", "dec"])
        await serves_token_exact(cluster, offset=0)

        pre, dec = await _record(cluster, "pre"), await _record(cluster, "dec")
        control_port = int(pre.control_address.rpartition(":")[2])
        peer_port = int(pre.peer_address.rpartition(":")[2])
        ip = cluster.network.address("a")
        transfers = sorted(_listening_ports(cluster, "a") - {control_port, peer_port})
        assert transfers, "pre lists no transfer endpoint"
        plan = {
            "peer": pre.peer_address,
            "impersonate": "dec",
            "lease": dec.lease,
            "transfers": [f"{ip}:{port}" for port in transfers],
            "ca_file": foreign.ca_file,
            "cert_file": foreign.cert_file,
            "key_file": foreign.key_file,
        }
        await trio.to_thread.run_sync(cluster.network.add, "x")
        with deadline("the intruder's attempts", 120):
            done = await trio.run_process(
                cluster.network.command(
                    "x", [sys.executable, "-m", "tests.hosts.intruder", json.dumps(plan)]
                ),
                capture_stdout=True,
                cwd=REPO,
            )
        outcomes = {
            line["attempt"]: line["outcome"] for line in map(json.loads, done.stdout.decode().splitlines())
        }
        assert len(outcomes) == 7 + len(transfers)
        assert all(outcome.startswith("closed") for outcome in outcomes.values()), outcomes

        assert cluster.nodes["pre"].running  # the forged shutdown did not stop it
        await serves_token_exact(cluster, offset=2)
        refused = _diagnostics(cluster, "pre", "cluster.peer_refused")
        intruder = cluster.network.address("x")
        assert sum(entry.get("remote", "").startswith(f"{intruder}:") for entry in refused) >= 7, refused
        assert any("'bad' did not prove the cluster secret" in entry["reason"] for entry in refused), refused
        links = _diagnostics(cluster, "pre", "transfer.link_refused")
        assert sum(entry["remote"].startswith(f"{intruder}:") for entry in links) == len(transfers), links
        assert not _stopped(cluster, "pre")
        for address in (cluster.nodes["pre"].address, cluster.nodes["dec"].address):
            assert address is not None
            async with ControlClient.connect(address, token=cluster.token) as client:
                await wait_idle(client)
