"""A pull within one node (docs/prefix-cache.md, "Pulls"): the replica that computed a prompt became a
decode replica, its cache kept; the next prompt with that prefix runs on the other prefill replica,
which pulls the prefix from the decode replica's cache instead of computing it. The output is the
model's run in one piece, and the node stops with nothing leaked (borrowings included)."""

from __future__ import annotations

import random
from pathlib import Path

from replicas.model import Model
from tests.node.harness import by_name, default_transport, node_process, wait_idle, wait_serving, wait_states
from tests.node.workload import Ask, check_outcome, send


async def test_a_prefix_is_pulled_from_another_replica_of_the_node(tmp_path: Path, tiny: Model) -> None:
    rng = random.Random(11)
    vocabulary = [i for i in range(tiny.config.vocab_size) if i != tiny.config.image_token_id]
    first = tuple(rng.choice(vocabulary) for _ in range(70))  # 4 full blocks and 6 tokens
    follow_up = (*first, *(rng.choice(vocabulary) for _ in range(30)))
    options = ("--replicas", "prefill=2,decode=1", "--prefix-pull", "always")
    with node_process(tmp_path, *options) as node:
        async with node.client() as client:
            await wait_serving(client)
            computed = await send(client, Ask(input_ids=first, max_tokens=3, ignore_eos=True))
            await wait_idle(client)
            await client.transition("prefill-0", "MutatingToDecode")  # the holder stops prefilling
            status = await wait_states(client, {"prefill-0": "Decode"})
            assert by_name(status)["prefill-0"].prefix_blocks == 4
            pulled = await send(client, Ask(input_ids=follow_up, max_tokens=4, seed=2, temperature=0.7))
            await wait_idle(client)
        started = {e["request_id"]: e for e in node.events("prefill_started")}
        (pull,) = [e for e in node.events("transfer_finished") if e["kind"] == "pull"]
    assert (pulled.result.cached_tokens, pulled.result.cached_from) == (64, "prefill-0")
    assert started[pulled.result.request_id]["replica"] == "prefill-1"
    assert (pull["status"], pull["source"], pull["destination"], pull["tokens"]) == (
        "success",
        "prefill-0",
        "prefill-1",
        64,
    )
    for outcome in (computed, pulled):
        assert check_outcome(tiny, outcome, transport=default_transport()) == []
