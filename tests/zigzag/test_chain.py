"""A multicast chain through a real node: `scale prefill` starting three replicas from one peer makes
each copy every piece from the replica started just before it, as soon as it landed there; a link of the
chain that fails mid-copy leaves the replicas after it going on from another source at the piece
reached. Every new replica then serves the model's tokens."""

from __future__ import annotations

from pathlib import Path

from replicas.model import Model
from tests.node.harness import default_transport, node_process, wait_idle, wait_serving, wait_status
from tests.node.workload import assert_correct, distinct_asks, send


def _by_replica(events: list[dict[str, object]]) -> dict[object, dict[str, object]]:
    return {event["replica"]: event for event in events}


async def test_three_replicas_load_as_a_chain_from_one_peer(tmp_path: Path, tiny: Model) -> None:
    with node_process(tmp_path, "--replicas", "prefill=1,decode=1") as node:
        async with node.client() as client:
            await wait_serving(client)
            result = await client.scale("prefill", 4, mode="stop_the_world", source="peer")
            assert [(s.replica, s.source) for s in result.started] == [
                (f"prefill-{n}", "peer") for n in (1, 2, 3)
            ]
            await wait_status(
                client,
                lambda s: sum(r.state == "Prefill" for r in s.replicas) == 4,
                "four prefill replicas serving",
            )
            started = _by_replica(node.events("weights_copy_started"))
            assert started["prefill-1"]["peers"] == ["decode-0"]
            assert started["prefill-2"]["peers"] == ["prefill-1", "decode-0"]
            assert started["prefill-3"]["peers"] == ["prefill-2", "decode-0"]
            assert str(started["prefill-3"]["reason"]).startswith(
                "a multicast chain: replica prefill-2 loads"
            )
            finished = _by_replica(node.events("weights_copy_finished"))
            for name in ("prefill-1", "prefill-2", "prefill-3"):
                assert finished[name]["status"] == "success" and finished[name]["fallbacks"] == [], finished
            outcomes = [await send(client, ask) for ask in distinct_asks(4, max_tokens=4)]
            assert_correct(tiny, outcomes, transport=default_transport())
            await wait_idle(client)


async def test_a_failed_link_of_the_chain_leaves_the_rest_going_on_from_another_source(
    tmp_path: Path, tiny: Model
) -> None:
    # The chain's link prefill-1 → prefill-2 breaks once 300 kB crossed it (the link, not the replicas).
    drop = "drop_link:source=prefill-1,destination=prefill-2,after_bytes=300000"
    with node_process(tmp_path, "--replicas", "prefill=1,decode=1", "--fault", drop) as node:
        async with node.client() as client:
            await wait_serving(client)
            await client.scale("prefill", 4, mode="stop_the_world", source="auto")
            await wait_status(
                client,
                lambda s: sum(r.state == "Prefill" for r in s.replicas) == 4,
                "four prefill replicas serving",
            )
            finished = _by_replica(node.events("weights_copy_finished"))
            for name in ("prefill-1", "prefill-3"):
                assert finished[name]["status"] == "success" and finished[name]["fallbacks"] == [], finished
            assert finished["prefill-2"]["status"] == "success", finished["prefill-2"]
            fallbacks = finished["prefill-2"]["fallbacks"]
            assert isinstance(fallbacks, list) and len(fallbacks) == 1, fallbacks
            assert fallbacks[0]["weights_source"] == "peer", fallbacks
            assert str(fallbacks[0]["reason"]).startswith("prefill-1: "), fallbacks
            # the chain's later link still forwarded every piece
            started = _by_replica(node.events("weights_copy_started"))
            assert started["prefill-3"]["peers"][0] == "prefill-2"  # type: ignore[index]
            outcomes = [await send(client, ask) for ask in distinct_asks(4, max_tokens=4)]
            assert_correct(tiny, outcomes, transport=default_transport())
            await wait_idle(client)
