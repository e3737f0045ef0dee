"""`cancel` at each place a request can wait, on a node of its own whose KV transfers stall
(`--fault stall_sender:replica=prefill-0,seconds=5`: prefill-0 waits 5 s before writing each chunk), so
that a request is reliably caught in the middle of its transfer. Wherever it is cancelled — half-way
through its KV transfer, prefilled and waiting for a decode replica, or queued in the router — its
generate ends with a result whose finish_reason is `cancelled` (not an error), its token so far is the
model's, and every block returns. (Cancelling while decoding is in `test_slow_clients.py`.) Then, with
that stalled transfer in flight, a second SIGTERM ends the draining node at once (exit code 130).
"""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio

from engine.client import ControlClient, ControlConnectionClosed
from replicas.model import Model
from tests.node.harness import by_name, node_process, wait_idle, wait_serving, wait_states, wait_status
from tests.node.workload import Ask, Outcome, assert_model_tokens, distinct_asks, send


async def cancelled_outcome(
    client: ControlClient, ask: Ask, request_id: str, caught: Callable[[], Awaitable[object]]
) -> Outcome:
    """Send `ask` as `request_id`, cancel it once `caught()` returns, and return its outcome."""
    outcomes: list[Outcome] = []

    async def run() -> None:
        outcomes.append(await send(client, ask, request_id=request_id))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        await caught()
        assert (await client.cancel(request_id)).request_id == request_id
    (outcome,) = outcomes
    assert outcome.result.finish_reason == "cancelled", outcome.result
    return outcome


@pytest.mark.slow
async def test_cancel_mid_transfer_in_the_migration_queue_and_in_the_router_queue(
    tmp_path: Path, tiny: Model
) -> None:
    with node_process(
        tmp_path, "--replicas", "prefill=1,decode=1", "--fault", "stall_sender:replica=prefill-0,seconds=5"
    ) as node:
        ask = distinct_asks(1, max_tokens=8, offset=400)[0]
        async with node.client() as client:
            await wait_serving(client)

            # Mid-transfer: prefill-0 stalls before its first chunk; the cancel aborts both sides.
            outcome = await cancelled_outcome(
                client,
                ask,
                "mid-transfer",
                lambda: node.wait_event("transfer_started", lambda e: e["request_id"] == "mid-transfer"),
            )
            assert len(outcome.result.token_ids) == 1
            assert_model_tokens(tiny, ask, outcome.result.token_ids)
            await wait_idle(client)
            finished = await node.wait_event("transfer_finished", lambda e: e["request_id"] == "mid-transfer")
            assert (finished["status"], finished["reason"], finished["bytes"]) == ("failed", "aborted", 0)

            # In the migration queue: decode-0 is locked, the prefilled request waits for it.
            await client.lock("decode-0")
            outcome = await cancelled_outcome(
                client,
                ask,
                "in-migration-queue",
                lambda: wait_status(
                    client,
                    lambda s: by_name(s)["prefill-0"].migration_queue == 1,
                    "the request waiting for a decode replica",
                ),
            )
            assert len(outcome.result.token_ids) == 1
            assert_model_tokens(tiny, ask, outcome.result.token_ids)
            await client.unlock("decode-0")
            await wait_idle(client)

            # In the router's queue: no prefill replica serves.
            await client.transition("prefill-0", "ShuttingPrefill")
            await wait_states(client, {"prefill-0": "ShuttingNull"})
            outcome = await cancelled_outcome(
                client,
                ask,
                "in-router-queue",
                lambda: node.wait_event("request_queued", lambda e: e["request_id"] == "in-router-queue"),
            )
            assert outcome.result.token_ids == [] and outcome.result.transfers == []
            await client.transition("prefill-0", "AusPrefill")
            await wait_serving(client)
            await wait_idle(client)
        reasons = {e["request_id"]: e["reason"] for e in node.events("request_cancelled")}
        assert reasons == dict.fromkeys(
            ("mid-transfer", "in-migration-queue", "in-router-queue"), "cancel_op"
        )
        assert not node.events("request_failed")

        # SIGTERM drains (the stalled request would hold the node for seconds); a second one exits at once.
        async with node.client() as client:
            lost: list[BaseException] = []

            async def stalled() -> None:
                try:
                    await send(client, ask, request_id="stalled")
                except ControlConnectionClosed as exc:
                    lost.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(stalled)
                await node.wait_event("transfer_started", lambda e: e["request_id"] == "stalled")
                node.process.send_signal(signal.SIGTERM)
                await node.wait_event("node_stopping", lambda e: e["reason"] == "signal")
                node.process.send_signal(signal.SIGTERM)
            assert len(lost) == 1
        assert await trio.to_thread.run_sync(node.wait_exit) == 130
        assert [e["detail"] for e in node.events("node_stopping")] == [
            "signal SIGTERM",
            "second signal: exiting at once",
        ]
