"""A node that cannot listen for the other nodes on its `--cluster-host` (no such host, not an address of
this machine), or that etcd refuses its password, stops in one line, exit 2, with what to give instead;
through a real node and a real etcd."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import trio

from engine.cluster.local_etcd import LocalEtcd
from tests.cluster.conftest import etcd_with_users
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


@pytest.mark.slow
async def test_a_node_with_a_wrong_etcd_password_stops_in_one_line(tmp_path: Path) -> None:
    async with etcd_with_users(tmp_path, "/zigzag/auth-test/", tls=False) as (local, _ca):
        assert local.auth is not None
        command = [*NODE, "--cluster", local.url, "--cluster-name", "auth-test"]
        command += ["--etcd-username", local.auth.user]
        env = os.environ | {"ZIGZAG_ETCD_PASSWORD": local.auth.password + "x"}
        with deadline("the node to stop", START_TIMEOUT):
            done = await trio.run_process(
                command, capture_stdout=True, capture_stderr=True, check=False, cwd=REPO_ROOT, env=env
            )
    assert (done.returncode, done.stderr.decode()) == (
        2,
        "engine.node: cannot join the cluster: etcd auth/authenticate failed: etcdserver: authentication "
        "failed, invalid user ID or password (code 3); give the user and password etcd knows "
        "(--etcd-username, $ZIGZAG_ETCD_PASSWORD)\n",
    )
