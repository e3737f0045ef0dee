"""Flush for real, then `scale` and a `shutdown` that drains, on one node of its own (prefill=1, decode=1).

1. Flush (architecture §6): with decode-0 locked, prefilled requests fill prefill-0's migration queue; the
   `transition` to MutatingToDecode makes prefill-0 adopt them — their KV is already in its blocks — and
   become a Decode replica. They finish on it, token-identical, with zero KV transfers.
2. Scale: the node now has no prefill replica; `scale prefill 1` adds a new one (prefill-1), which serves;
   `scale decode 1` shuts the least loaded of the two decode replicas down (ShuttingNull).
3. Shutdown: the `shutdown` op with requests in flight stops admitting (`shutting_down`), lets them
   finish, and the node exits 0 (no block leaked).

Steps 2 and 3 need a node whose roles changed or that ends, so they share this node (a start costs seconds).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from engine.client import ControlError
from replicas.model import Model
from tests.node.harness import (
    by_name,
    default_transport,
    node_process,
    wait_idle,
    wait_serving,
    wait_states,
    wait_status,
)
from tests.node.workload import Outcome, assert_correct, distinct_asks, launch, send


@pytest.mark.slow
async def test_flush_then_scale_then_a_draining_shutdown(tmp_path: Path, tiny: Model) -> None:
    with node_process(tmp_path, "--replicas", "prefill=1,decode=1") as node:
        async with node.client() as client:
            await wait_serving(client)
            await client.lock("decode-0")
            queued = distinct_asks(4, max_tokens=6, offset=200)
            flushed: list[Outcome] = []
            async with trio.open_nursery() as nursery:
                launch(nursery, client, queued, flushed)
                status = await wait_status(
                    client,
                    lambda s: by_name(s)["prefill-0"].migration_queue == len(queued),
                    "the prefilled requests waiting in prefill-0's migration queue",
                )
                assert by_name(status)["prefill-0"].used_blocks > 0  # their prompt KV, held there
                result = await client.transition("prefill-0", "MutatingToDecode")
                assert (result.previous, result.state) == ("Prefill", "MutatingToDecode")
            status = await wait_states(client, {"prefill-0": "Decode"})
            prefill_0 = by_name(status)["prefill-0"]
            assert (prefill_0.role, prefill_0.locked) == ("decode", False)
            assert_correct(
                tiny, flushed, transport=default_transport(), kv_moves=False
            )  # and no transfer each
            ids = {o.result.request_id for o in flushed}
            assert not [e for e in node.events("transfer_started") if e["request_id"] in ids]
            moves = [
                (e["from"], e["to"], e["trigger"])
                for e in node.events("replica_state")
                if e["replica"] == "prefill-0"
            ]
            assert moves[-2:] == [
                ("Prefill", "MutatingToDecode", "command"),
                ("MutatingToDecode", "Decode", "automatic"),
            ]

            # No prefill replica left: scale one up (a new replica), and the decode replicas down to one.
            scaled = await client.scale("prefill", 1)
            assert (scaled.target, scaled.replicas) == (1, ["prefill-1"])
            await wait_states(client, {"prefill-1": "Prefill"})
            await client.unlock("decode-0")
            served = [await send(client, ask) for ask in distinct_asks(2, max_tokens=3, offset=210)]
            assert_correct(tiny, served, transport=default_transport())
            assert {o.result.transfers[0].source for o in served} == {"prefill-1"}
            scaled = await client.scale("decode", 1)
            assert scaled.target == 1 and len(scaled.replicas) == 1
            (kept,) = scaled.replicas
            (shut,) = {"prefill-0", "decode-0"} - {kept}
            await wait_states(client, {shut: "ShuttingNull", kept: "Decode"})
            await wait_idle(client)

            # Shutdown with requests in flight: they finish, nothing new is admitted, exit 0.
            draining: list[Outcome] = []
            async with trio.open_nursery() as nursery:
                launch(nursery, client, distinct_asks(3, max_tokens=40, offset=220), draining)
                await wait_status(
                    client, lambda s: by_name(s)[kept].used_blocks > 0, "the requests decoding on " + kept
                )
                stopping = await client.shutdown()
                assert stopping.in_flight == 3
                with pytest.raises(ControlError) as refused:
                    await client.generate_result(input_ids=[1, 2, 3], max_tokens=2)
                assert refused.value.code == "shutting_down"
            assert_correct(tiny, draining, transport=default_transport())
            assert all(len(o.result.token_ids) == 40 for o in draining)
        code = await trio.to_thread.run_sync(node.wait_exit)
        assert code == 0, node.diagnosis()
        (stopping_event,) = node.events("node_stopping")
        assert (stopping_event["reason"], stopping_event["in_flight"]) == ("shutdown_op", 3)
        (stopped,) = node.events("node_stopped")
        assert (stopped["exit_code"], stopped["leaked_blocks"]) == (0, 0)
        assert not [e for e in node.events("request_cancelled") if e["reason"] == "shutdown"]
