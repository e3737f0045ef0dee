"""KV-aware routing across nodes (docs/prefix-cache.md): each node reports its replicas' prefix-cache keys
to the others; a prompt sent to one node goes to the other node's prefill replica that holds its prefix,
which computes only the rest, and the output is the model's run in one piece."""

from __future__ import annotations

import random
from pathlib import Path

from engine.cluster.local_etcd import LocalEtcd
from replicas.model import tiny_model
from tests.cluster.harness import cluster_nodes, cluster_transport
from tests.node.harness import by_name, wait_idle, wait_status
from tests.node.workload import Ask, check_outcome, send

LAYOUT = (("a", "encode=0,prefill=1,decode=1"), ("b", "encode=0,prefill=1,decode=1"))


async def test_a_prompt_goes_to_the_node_that_holds_its_prefix(tmp_path: Path, etcd: LocalEtcd) -> None:
    model = tiny_model()
    rng = random.Random(3)
    vocabulary = [i for i in range(model.config.vocab_size) if i != model.config.image_token_id]
    first = tuple(rng.choice(vocabulary) for _ in range(80))
    ask = Ask(input_ids=first, max_tokens=3, ignore_eos=True)
    follow_up = Ask(input_ids=(*first, *(rng.choice(vocabulary) for _ in range(20))), max_tokens=3, seed=5)
    async with cluster_nodes(tmp_path, etcd, LAYOUT) as nodes:
        async with nodes["a"].client() as client:
            alone = await send(client, ask)  # a's own prefill replica (this node's first on a tie)
            await wait_idle(client)
        async with nodes["b"].client() as client:
            await wait_status(
                client,
                lambda status: by_name(status)["a/prefill-0"].prefix_blocks == 5,
                "node a's report of its prefix cache reaching node b",
            )
            routed = await send(client, follow_up)
            await wait_idle(client)
        started = {e["request_id"]: e for e in nodes["a"].events("prefill_started")}
    assert started[alone.result.request_id]["cached_tokens"] == 0
    assert started[routed.result.request_id]["replica"] == "a/prefill-0"
    assert started[routed.result.request_id]["cached_tokens"] == 80
    for outcome in (alone, routed):
        assert check_outcome(model, outcome, transport=cluster_transport()) == []
