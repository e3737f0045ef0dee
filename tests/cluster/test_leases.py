"""A command that acts on a lock or a reservation carries its sender's lease, and a stale one is refused;
work addressed to an earlier incarnation of a node is not started there.

The tests join the cluster themselves as member `probe` (a record under its own lease, and peer links of
its own, `engine.cluster.peers`). They send a node `Lock` commands: under a lease that is not its current
one the node answers `stale_lease`; under its current lease the replica locks. And they submit a request
to a node's prefill replica addressed to another lease of that node (`PeerFrame.to_lease`): it is
returned, never prefilled; addressed to its current lease, it runs.
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
    RequestSnapshot,
    Returned,
    RunCommand,
    SamplingRecord,
    StampsRecord,
    Submit,
)
from messages.commands import Lock
from replicas.inbox import new_command_id
from tests.cluster.harness import cluster_nodes
from tests.node.harness import wait_idle, wait_status
from tests.waiting import wait_until


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
        record = _probe_record(lease.id, address)
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


def _probe_record(lease: int, address: str) -> NodeRecord:
    return NodeRecord(
        node_id="probe",
        pid=0,
        lease=lease,
        peer_address=address,
        control_address="",
        http_url=None,
        identity=ClusterIdentity(model="tiny", dtype="float32", kv_block_size=16, embedding_block_size=128),
        capacity=NodeCapacity(devices=[], memory_bytes=0, free_replica_slots=0),
        replicas=[],
        weights=[],
        started=time.time(),
    )


def _snapshot(request_id: str) -> RequestSnapshot:
    prompt = [3 + i % 200 for i in range(40)]
    return RequestSnapshot(
        request_id=request_id,
        origin="probe",
        prompt_ids=prompt,
        images=[],
        sampling=SamplingRecord(
            temperature=0.0, top_p=1.0, seed=0, ignore_eos=True, eos_banned_before=0, eos_token_ids=[]
        ),
        max_tokens=2,
        eos_token_ids=[],
        token_ids=prompt,
        generated=[],
        next_position=len(prompt),
        stop_at=None,
        cancelled=False,
        stamps=StampsRecord(arrived=time.time()),
        transfers=[],
        relay=None,
    )


async def test_a_submit_to_an_earlier_incarnation_is_returned_not_prefilled(
    tmp_path: Path, etcd: LocalEtcd
) -> None:
    """The origin's frame names the lease it knows the node under: one that is not the node's lease now
    (the node rejoined meanwhile, and its origin ended the request when it saw that) gets `Returned`
    and leaves no trace in the node's replicas; the same request under the node's lease is prefilled."""
    async with (
        cluster_nodes(tmp_path, etcd, (("holder", "encode=0,prefill=1,decode=1"),)) as nodes,
        nodes["holder"].client() as client,
        Etcd(etcd.url) as store,
        trio.open_nursery() as nursery,
    ):
        lease = await store.grant(30)
        returned: list[str] = []

        def on_frame(frame: PeerFrame) -> None:
            if isinstance(frame.message, Returned):
                returned.append(frame.message.request_id)

        raw = await store.get("/zigzag/default/nodes/holder")
        assert raw is not None
        holder = msgspec.json.decode(raw.value, type=NodeRecord)
        addressed = {"holder": holder.lease + 1}  # an incarnation of holder that is not the current one
        links = PeerLinks("probe", lambda: lease.id, on_frame, known_lease=lambda node: addressed[node])
        address = await nursery.start(links.run, "127.0.0.1")
        await store.put(
            "/zigzag/default/nodes/probe",
            msgspec.json.encode(_probe_record(lease.id, address)),
            lease=lease.id,
        )
        await wait_status(
            client, lambda s: s.cluster is not None and "probe" in s.cluster.nodes, "holder seeing probe"
        )
        links.set_address("holder", holder.peer_address)

        links.send("holder", Submit(replica="holder/prefill-0", request=_snapshot("to-old-incarnation")))
        await wait_until(lambda: "to-old-incarnation" in returned, "the stale submit returned", 30)

        addressed["holder"] = holder.lease
        links.send("holder", Submit(replica="holder/prefill-0", request=_snapshot("to-this-incarnation")))
        node = nodes["holder"]
        await node.wait_event(
            "prefill_started", lambda e: e["request_id"] == "to-this-incarnation", timeout=60
        )
        assert not [e for e in node.events() if e.get("request_id") == "to-old-incarnation"]
        refused = [e for e in node.events("diagnostic") if e["name"] == "cluster.frame_to_old_incarnation"]
        assert [e["fields"]["message"] for e in refused] == ["Submit"]
        await wait_idle(client)
        await store.revoke(lease.id)
        nursery.cancel_scope.cancel()
