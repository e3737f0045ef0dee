"""What a member tells the others: its etcd record and its replicas' reports (`messages.cluster`)."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from engine.service import replica_status
from messages.cluster import NodeCapacity, NodeRecord, ReplicaEntry, ReplicaReport, Report
from replicas.actor import Replica
from replicas.states import SETTLED, STATES

if TYPE_CHECKING:
    from engine.cluster.member import ClusterMember


def replica_report(replica: Replica, member: ClusterMember) -> ReplicaReport:
    return ReplicaReport(
        status=replica_status(replica, node=member.node_id, pid=member.pid),
        role=replica.role,
        kv_total=replica.pools.kv_usage()[1],
        queued_prompt_tokens=sum(q.prompt_tokens for q in replica.work.prefill.queue),
        encode_load=replica.work.encode.load,
        embedding_pool=replica.pools.emb_endpoint is not None,
        # Cross-node work goes to replicas serving plainly (ZigZag pairs stay within their node).
        takes_work=replica.state in SETTLED
        and STATES[replica.state].role != "decode"
        and replica.nursery is not None,
    )


def build_report(member: ClusterMember) -> Report:
    services = member.services
    return Report(
        accepting=member.router.accepting,
        replicas=[replica_report(r, member) for r in services.replicas.values()],
        endpoints=services.fabric.local_addresses,
        pid=member.pid,
        pending_tokens=sum(r.prompt_tokens for r in member.router.pending),
        load=member.node.metrics.load.totals,
    )


def node_record(member: ClusterMember, peer_address: str) -> NodeRecord:
    node = member.node
    config = node.config
    replicas = node.services.replicas.values()
    return NodeRecord(
        node_id=member.node_id,
        pid=member.pid,
        lease=member.membership.lease,
        peer_address=peer_address,
        control_address=node.control_address or "",
        http_url=node.http_url,
        identity=node.identity(),
        capacity=NodeCapacity(
            devices=[config.device],
            memory_bytes=_memory_bytes(),
            free_replica_slots=max(0, config.cluster.replica_slots - len(replicas)),
        ),
        replicas=[ReplicaEntry(name=r.name, role=r.role) for r in replicas],
        weights=[node.host.name],
        started=time.time() - (time.monotonic() - node.started),
    )


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0
