"""`new_member`: a node's cluster member from its `--cluster` options (nothing contacted until `run`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.cluster.etcd import Etcd, EtcdTls
from engine.cluster.member import ClusterMember
from engine.cluster.membership import Membership
from messages.faults import BlockKeepalive

if TYPE_CHECKING:
    from engine.node import Node


def new_member(node: Node) -> ClusterMember:
    """The member of `node` for its `--cluster` config (nothing is contacted until `run`)."""
    config = node.config.cluster
    assert config.cluster is not None
    tls = None
    if config.etcd_ca_file or config.etcd_cert_file:
        tls = EtcdTls(
            ca_file=config.etcd_ca_file, cert_file=config.etcd_cert_file, key_file=config.etcd_key_file
        )
    etcd = Etcd(config.cluster, tls=tls, username=config.etcd_username, password=config.etcd_password)
    block = next((f for f in node.config.faults if isinstance(f, BlockKeepalive)), None)
    membership = Membership(
        etcd,
        cluster_name=config.cluster_name,
        node_id=node.node_id,
        ttl=config.lease_ttl,
        on_change=lambda: None,
        block=block,
    )
    return ClusterMember(node, membership)
