"""A node that cannot listen for the other nodes on its `--cluster-host` (no such host, not an address of
this machine) stops in one line, exit 2, with what to give instead; through a real node and a real etcd."""

from __future__ import annotations

import sys

import pytest
import trio

from engine.cluster.local_etcd import LocalEtcd
from tests.node.harness import REPO_ROOT, START_TIMEOUT
from tests.waiting import deadline

NODE = (sys.executable, "-m", "engine.node", "--no-log-console", "--listen", "127.0.0.1:0", "--http", "off")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("host", "reason"),
    [("no-such-host.invalid", "Name or service not known"), ("192.0.2.1", "Cannot assign requested address")],
    ids=["unknown host", "not this host's"],
)
async def test_a_cluster_host_the_node_cannot_listen_on_stops_it_in_one_line(
    etcd: LocalEtcd, host: str, reason: str
) -> None:
    command = [*NODE, "--cluster", etcd.url, "--cluster-host", host, "--transport", "tcp"]
    with deadline("the node to stop", START_TIMEOUT):
        done = await trio.run_process(
            command, capture_stdout=True, capture_stderr=True, check=False, cwd=REPO_ROOT
        )
    assert (done.returncode, done.stderr.decode()) == (
        2,
        f"engine.node: cannot listen for the other nodes on {host} (--cluster-host): {reason}; give an "
        "address of this host that the others reach\n",
    )
