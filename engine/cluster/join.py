"""`new_member`: a node's cluster member from its `--cluster` options (nothing contacted until `run`)."""

from __future__ import annotations

from collections.abc import Callable

from engine.cluster.etcd import Etcd, EtcdTls
from engine.cluster.member import ClusterMember, Handle
from engine.cluster.membership import Membership
from engine.core import NodeCore
from messages.cluster import LoadTotals


def new_member(core: NodeCore, *, handle: Handle, load: Callable[[], LoadTotals]) -> ClusterMember:
    """The member of node `core` for its `--cluster` config (nothing is contacted until `run`);
    `handle` serves a control op another node forwards, `load` is the node's load counters."""
    config = core.config.cluster
    assert config.cluster is not None
    tls = None
    if config.etcd_ca_file or config.etcd_cert_file:
        tls = EtcdTls(
            ca_file=config.etcd_ca_file, cert_file=config.etcd_cert_file, key_file=config.etcd_key_file
        )
    etcd = Etcd(config.cluster, tls=tls, username=config.etcd_username, password=config.etcd_password)
    membership = Membership(
        etcd,
        cluster_name=config.cluster_name,
        node_id=core.node_id,
        ttl=config.lease_ttl,
        on_change=lambda: None,
        blocked=core.faults.keepalive_blocked,
    )
    return ClusterMember(core, membership, handle=handle, load=load, credentials=core.credentials)
