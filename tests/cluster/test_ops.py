"""Any node serves the cluster's clients: `status` lists every replica with its node and pid, `lock` and
`scale` reach another node's replicas, `cancel` reaches a request admitted elsewhere, the leader's
`metrics` adds the cluster's totals, and `shutdown {"cluster": true}` stops every node.
"""

from __future__ import annotations

from pathlib import Path

import trio

from engine.cluster.local_etcd import LocalEtcd
from messages.control_replies import GenerateResult, StatusResult, TokenReply
from tests.cluster.harness import cluster_nodes, wait_cluster_serving
from tests.node.harness import wait_status
from tests.waiting import deadline

LAYOUT = (("lead", "encode=0,prefill=1,decode=1"), ("other", "encode=0,prefill=0,decode=1"))


async def test_control_ops_reach_every_node(tmp_path: Path, etcd: LocalEtcd) -> None:
    async with (
        cluster_nodes(tmp_path, etcd, LAYOUT[:1]) as first,
        cluster_nodes(
            tmp_path, etcd, LAYOUT[1:], "--emulated-speed", "decode_steps_per_s=25", joining=2
        ) as nodes,
        first["lead"].client() as lead,
        nodes["other"].client() as other,
    ):
        status = await wait_cluster_serving(lead, 3)  # lead has other's report too
        assert status.cluster is not None and status.cluster.leader == "lead"
        assert {r.name: r.node for r in status.replicas} == {
            "lead/prefill-0": "lead",
            "lead/decode-0": "lead",
            "other/decode-0": "other",
        }
        assert len({r.pid for r in status.replicas}) == 2
        # the leader's block report covers every node's replicas
        await first["lead"].wait_event(
            "blocks_report",
            lambda e: {r["replica"] for r in e["replicas"]} >= {"lead/decode-0", "other/decode-0"},
        )
        assert all(
            {r["replica"] for r in e["replicas"]} == {"other/decode-0"}
            for e in nodes["other"].events("blocks_report")
        )

        # lock and unlock another node's replica, by its cluster name and by its bare name
        locked = await lead.lock("other/decode-0")
        assert locked.locked and locked.lock_reasons == ["manual"]
        await wait_status(other, lambda s: _locks(s, "other/decode-0") == ["manual"], "the lock on other")
        unlocked = await other.unlock("decode-0")  # bare: other's own replica
        assert unlocked.lock_reasons == []

        # a generate admitted by `other`, cancelled through `lead`
        cancelled: list[GenerateResult] = []
        with deadline("the cancelled generate ended", 60):
            async with trio.open_nursery() as nursery:
                streaming = trio.Event()

                async def long() -> None:
                    async for reply in other.generate(
                        input_ids=list(range(3, 40)),
                        max_tokens=400,
                        ignore_eos=True,
                        stream=True,
                        request_id="long-one",
                    ):
                        if isinstance(reply, TokenReply):
                            streaming.set()
                        else:
                            cancelled.append(reply)

                nursery.start_soon(long)
                await streaming.wait()
                result = await lead.cancel("long-one")
                assert result.request_id == "long-one"
        assert cancelled[0].finish_reason == "cancelled"

        # the leader's metrics add the cluster's totals
        metrics = await lead.metrics()
        assert metrics.cluster is not None and sorted(metrics.cluster.nodes) == ["lead", "other"]
        assert metrics.cluster.requests.arrived >= 1 and metrics.cluster.requests.cancelled >= 1
        assert (await other.metrics()).cluster is None

        # scale on another node
        scaled = await lead.scale("decode", 2, node="other")
        assert "other/decode-1" in scaled.replicas
        await wait_status(
            lead,
            lambda s: any(r.name == "other/decode-1" and r.state == "Decode" for r in s.replicas),
            "other/decode-1 serving, seen from lead",
        )

        await lead.shutdown(cluster=True)
        every = (*first.values(), *nodes.values())
        codes = await trio.to_thread.run_sync(lambda: [n.wait_exit() for n in every])
        assert codes == [0, 0]


def _locks(status: StatusResult, name: str) -> list[str]:
    return next(list(r.lock_reasons) for r in status.replicas if r.name == name)
