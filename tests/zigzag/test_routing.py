"""ZigZag's routing through real nodes (docs/zigzag.md, "Routing during an episode"): while the OldPrefill
replica is the bottleneck and its NewPrefill partner has spare compute, every prompt goes through the
NewPrefill's loaded layers — new prompts from the router, and the prompts queued at the OldPrefill before
the episode, handed back — and the OldPrefill computes only the layers its partner lacks; on one node
and across two. Every output equals the model run in one piece (`engine.verify.compare`).

Speeds are emulated (`--emulated-speed`), so the OldPrefill, serving a long prompt and then every relay,
stays behind the burst whatever the machine; the new replica's copy is held before layer 2 (the
`hold_weights` fault hook), so every relay happens at layer 2 of the tiny model's 4, and released once
every request ended.
"""

from __future__ import annotations

from pathlib import Path

import trio

from engine.cluster.local_etcd import LocalEtcd
from messages.control_replies import StatusResult
from replicas.model import Model
from tests.cluster.harness import cluster_nodes, cluster_transport
from tests.node.harness import (
    by_name,
    default_transport,
    node_process,
    wait_idle,
    wait_serving,
    wait_states,
    wait_status,
)
from tests.node.workload import Ask, Outcome, assert_correct, distinct_asks, send, send_all

LAYER = 2  # the relays' boundary: the new replica holds layers [0, 2) of 4
BUDGET = 128  # --max-batch-tokens: the OldPrefill's queue holds at most this many prompt tokens
# The emulated accelerator: the long prompt below keeps the OldPrefill busy for 8 s, while the pairing
# (two commands, each answered in well under a second even on a loaded machine) happens.
SPEED = ("--emulated-speed", "prefill_tokens_per_s=32")
HOLD = ("--fault", f"hold_weights:before_layer={LAYER},seconds=600")
LONG = Ask(input_ids=tuple(range(3, 3 + BUDGET)) * 2, max_tokens=3, ignore_eos=True)  # runs alone


def _relays(outcomes: list[Outcome]) -> set[tuple[str, str, int] | None]:
    """Each outcome's relay as (new, old, layer); None: computed whole."""
    relays = (o.result.relay for o in outcomes)
    return {None if r is None else (r.new_prefill, r.old_prefill, r.layer) for r in relays}


async def test_a_backlog_on_the_old_prefill_goes_through_the_new_prefills_layers(
    tmp_path: Path, tiny: Model
) -> None:
    options = ["--replicas", "prefill=2,decode=1", "--max-batch-tokens", str(BUDGET), *SPEED, *HOLD]
    with node_process(tmp_path, *options) as node:
        async with node.client() as client:
            await wait_serving(client)
            # prefill-1 out of service, then loading again from the host copy, held before layer 2.
            await client.transition("prefill-1", "ShuttingPrefill")
            await wait_states(client, {"prefill-1": "ShuttingNull"})
            await client.transition("prefill-1", "Inactive")
            await client.transition("prefill-1", "LoadingPrefill", source="host")

            def holding(status: StatusResult) -> bool:
                return by_name(status)["prefill-1"].loaded_layers == LAYER

            await wait_status(client, holding, f"prefill-1 holding {LAYER} layers")
            queued = distinct_asks(3, max_tokens=4, offset=10)  # 20-22 tokens each: one batch together
            burst = distinct_asks(8, max_tokens=3, offset=30)  # 20-27 tokens each: more than a batch
            before: list[Outcome] = []
            after: list[Outcome] = []
            async with trio.open_nursery() as nursery:

                async def first(ask: Ask, request_id: str) -> None:
                    before.append(await send(client, ask, request_id=request_id))

                # The backlog: prefill-0 computes the long prompt, the three others wait in its queue.
                nursery.start_soon(first, LONG, "long")
                await node.wait_event("prefill_started", lambda e: e.get("request_id") == "long")
                for index, ask in enumerate(queued):
                    nursery.start_soon(first, ask, f"queued-{index}")
                await wait_status(
                    client, lambda s: by_name(s)["prefill-0"].work_queue == len(queued), "prefill-0's queue"
                )
                # The episode starts while the long prompt computes: the queue goes to prefill-1.
                await client.transition("prefill-1", "NewPrefill", paired_with="prefill-0")
                await wait_status(
                    client, lambda s: by_name(s)["prefill-0"].state == "OldPrefill", "prefill-0 OldPrefill"
                )
                after += await send_all(client, burst)
            assert (await client.release()).released == 1
            await wait_states(client, {"prefill-1": "Prefill", "prefill-0": "Prefill"})
            await wait_idle(client)
    long = [o for o in before if o.result.request_id == "long"]
    assert [o.result.relay for o in long] == [None]  # it had started: computed whole, as before
    relayed = [o for o in before if o.result.request_id != "long"] + after
    assert _relays(relayed) == {("prefill-1", "prefill-0", LAYER)}, "a prompt skipped the loaded layers"
    handed = node.events("relay_handed_over")
    assert sum(e["requests"] for e in handed) == len(relayed) == len(queued) + len(burst)
    assert not node.events("replica_failed")
    assert_correct(tiny, [*long, *relayed], transport=default_transport())


async def test_across_nodes_the_old_prefills_router_sends_every_prompt_through_the_new_node(
    tmp_path: Path, tiny: Model, etcd: LocalEtcd
) -> None:
    """Node `old` serves prefill and decode; `new` joins empty and takes a NewPrefill paired with `old`'s
    replica. The burst enters at `old`: its router sees the episode through `new`'s reports and sends
    every prompt to `new`'s replica, none to its own OldPrefill."""
    layout = [("old", "prefill=1,decode=1"), ("new", "prefill=0,decode=0")]
    extra = ("--max-batch-tokens", str(BUDGET), *SPEED, *HOLD)
    async with cluster_nodes(tmp_path, etcd, layout, *extra) as nodes, nodes["old"].client() as client:
        result = await client.scale("prefill", 1, node="new", mode="zigzag", source="disk")
        (started,) = result.started
        new = started.replica

        def holding(status: StatusResult) -> bool:
            replica = by_name(status).get(new)
            return replica is not None and replica.state == "NewPrefill" and replica.loaded_layers == LAYER

        status = by_name(await wait_status(client, holding, f"{new} NewPrefill holding {LAYER} layers"))
        (old,) = status[new].paired_with
        await wait_status(
            client, lambda s: by_name(s)[old].state == "OldPrefill", f"{old} OldPrefill, as `old` sees it"
        )
        burst = distinct_asks(8, max_tokens=3, offset=60)
        outcomes = await send_all(client, burst)
        async with nodes["new"].client() as on_new:
            assert (await on_new.release()).released == 1
        await wait_states(client, {new: "Prefill", old: "Prefill"})
        await wait_idle(client)
    assert _relays(outcomes) == {(new, old, LAYER)}, "a prompt skipped the new node's loaded layers"
    handed = nodes["new"].events("relay_handed_over")
    assert sum(e["requests"] for e in handed) == len(burst)
    assert_correct(tiny, outcomes, transport=cluster_transport())
