"""What a member tells the others: its etcd record and its replicas' reports (`messages.cluster`), built
from the node's core and its replicas' snapshots."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

from engine.core import NodeCore
from engine.service import replica_status
from messages.cluster import (
    LoadTotals,
    NodeCapacity,
    NodeRecord,
    PrefixDelta,
    ReplicaEntry,
    ReplicaReport,
    Report,
)
from replicas.snapshot import ReplicaSnapshot
from replicas.states import SETTLED, STATES, ReplicaState


def replica_report(
    snap: ReplicaSnapshot, *, transport: str, node: str, pid: int, prefix: PrefixDelta | None = None
) -> ReplicaReport:
    return ReplicaReport(
        status=replica_status(snap, transport=transport, node=node, pid=pid),
        role=snap.role,
        kv_total=snap.kv_blocks,
        queued_prompt_tokens=snap.queued_prompt_tokens,
        encode_load=snap.encode_load,
        embedding_pool=snap.embedding_pool,
        # Cross-node work goes to replicas serving plainly and to a NewPrefill, prompts up to its limit,
        # as this node's router sends them (an OldPrefill takes only its own node's, while its episode lets it).
        takes_work=snap.running
        and (
            (snap.state in SETTLED and STATES[snap.state].role != "decode")
            or (snap.state is ReplicaState.NEW_PREFILL and snap.takes_prefill)
        ),
        serves_weights=snap.serves_weights,
        prefix=prefix,
        prefill_limit=snap.prefill_limit,
        running_prompt_tokens=snap.running_prompt_tokens,
    )


def build_report(
    core: NodeCore, *, pid: int, load: LoadTotals, prefix_since: Mapping[str, int] | None = None
) -> Report:
    """Node `core`'s report (its process `pid`, its `load` counters); each replica's prefix cache as a
    delta from the version in `prefix_since` (None, or a replica not in it: a whole view)."""
    router, transport = core.router, core.fabric.kind
    since = prefix_since or {}
    return Report(
        accepting=router.accepting,
        replicas=[
            replica_report(
                r.snapshot(),
                transport=transport,
                node=core.node_id,
                pid=pid,
                prefix=r.prefix_delta(since.get(r.name) if prefix_since is not None else None),
            )
            for r in core.directory.local()
        ],
        endpoints=core.fabric.local_addresses,
        pid=pid,
        pending_tokens=router.pending_tokens,
        load=load,
    )


def prefix_versions(report: Report) -> dict[str, int]:
    """Replica name → the prefix-cache version `report` brings its readers to."""
    return {e.status.name: e.prefix.version for e in report.replicas if e.prefix is not None}


def node_record(core: NodeCore, *, node_id: str, pid: int, lease: int, peer_address: str) -> NodeRecord:
    config = core.config
    replicas = core.directory.local()
    return NodeRecord(
        node_id=node_id,
        pid=pid,
        lease=lease,
        peer_address=peer_address,
        control_address=core.control_address or "",
        http_url=core.http_url,
        identity=core.identity(),
        capacity=NodeCapacity(
            devices=[config.device],
            memory_bytes=_memory_bytes(),
            free_replica_slots=max(0, config.cluster.replica_slots - len(replicas)),
        ),
        replicas=[ReplicaEntry(name=r.name, role=r.role) for r in replicas],
        weights=[core.host.name],
        started=time.time() - (time.monotonic() - core.started),
    )


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0
