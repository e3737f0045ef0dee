"""A command that acts on a lock or a reservation carries its sender's lease, and a stale one is refused.

The test joins the cluster itself as member `probe` (a record under its own lease, and peer links of
its own, `engine.cluster.peers`) and sends a node `Lock` commands: under a lease that is not its current
one the node answers `stale_lease`; under its current lease the replica locks.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import trio

from engine.cluster.etcd import Etcd
from engine.cluster.local_etcd import LocalEtcd
from engine.cluster.peers import PeerLinks, new_correlation
from messages.cluster import (
    ClusterIdentity,
    CommandOutcome,
    NodeCapacity,
    NodeRecord,
    PeerFrame,
    RunCommand,
)
from messages.commands import Lock
from replicas.inbox import new_command_id
from tests.cluster.harness import cluster_nodes
from tests.node.harness import wait_status


async def test_a_lock_under_a_stale_lease_is_refused(tmp_path: Path, etcd: LocalEtcd) -> None:
    async with (
        cluster_nodes(tmp_path, etcd, (("holder", "encode=0,prefill=1,decode=1"),)) as nodes,
        nodes["holder"].client() as client,
        Etcd(etcd.url) as store,
        trio.open_nursery() as nursery,
    ):
        lease = await store.grant(30)
        sent_lease = lease.id + 1  # not the probe's lease: stale

        def on_frame(frame: PeerFrame) -> None:
            if isinstance(frame.message, CommandOutcome):
                links.answer(frame.message)

        links = PeerLinks("probe", lambda: sent_lease, on_frame)
        address = await nursery.start(links.run, "127.0.0.1")
        record = NodeRecord(
            node_id="probe",
            pid=0,
            lease=lease.id,
            peer_address=address,
            control_address="",
            http_url=None,
            identity=ClusterIdentity(
                model="tiny", dtype="float32", kv_block_size=16, embedding_block_size=128
            ),
            capacity=NodeCapacity(devices=[], memory_bytes=0, free_replica_slots=0),
            replicas=[],
            weights=[],
            started=time.time(),
        )
        await store.put("/zigzag/default/nodes/probe", msgspec.json.encode(record), lease=lease.id)
        await wait_status(
            client, lambda s: s.cluster is not None and "probe" in s.cluster.nodes, "holder seeing probe"
        )
        holder = await store.get("/zigzag/default/nodes/holder")
        assert holder is not None
        links.set_address("holder", msgspec.json.decode(holder.value, type=NodeRecord).peer_address)

        async def lock() -> CommandOutcome:
            correlation = new_correlation("probe")
            command = Lock(command_id=new_command_id(), reason="manual")
            message = RunCommand(correlation=correlation, replica="holder/decode-0", command=command)
            outcome = await links.ask("holder", message, correlation, timeout=30)
            assert isinstance(outcome, CommandOutcome)
            return outcome

        stale = await lock()
        assert stale.error_code == "stale_lease"
        assert stale.error_message == (
            f"Lock from node probe under lease {sent_lease:x}, which is not its current one"
        )
        status = await client.status()
        assert next(r for r in status.replicas if r.name == "holder/decode-0").lock_reasons == []

        sent_lease = lease.id
        current = await lock()
        assert current.error_code is None and current.result == ["manual"]
        await store.revoke(lease.id)
        nursery.cancel_scope.cancel()
