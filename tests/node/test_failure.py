"""A replica whose task raises, and a SIGTERM that drains, on one node of its own (prefill=1, decode=2).

`--fault fail_replica:replica=decode-0,after_steps=30`: decode-0's loop raises on its 31st step — after
start-up (a handful of steps) and while it decodes the requests it took (each of which needs 100
steps). Its requests get `replica_failed`; `status` shows it `Inactive` with `last_error` and no block
held; the node keeps serving on decode-1, and decode-0 can be loaded again. Then SIGTERM with requests
in flight: they finish and the node exits 0.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import trio

from engine.client import ControlClient, ControlError
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
from tests.node.workload import (
    Ask,
    Outcome,
    assert_correct,
    assert_model_tokens,
    distinct_asks,
    launch,
    reserved_blocks,
    send,
)
from tests.waiting import deadline

INJECTED = "InjectedFault: decode-0: injected failure (fail_replica fault hook)"


async def send_or_error(client: ControlClient, ask: Ask, into: list[Outcome | ControlError]) -> None:
    try:
        into.append(await send(client, ask))
    except ControlError as exc:
        into.append(exc)


@pytest.mark.slow
async def test_a_failing_replica_fails_its_requests_and_the_node_serves_on(
    tmp_path: Path, tiny: Model
) -> None:
    with node_process(
        tmp_path,
        "--replicas",
        "prefill=1,decode=2",
        "--fault",
        "fail_replica:replica=decode-0,after_steps=30",
        stop="sigterm",
    ) as node:
        async with node.client() as client:
            await wait_serving(client)
            outcomes: list[Outcome | ControlError] = []
            async with trio.open_nursery() as nursery:
                for ask in distinct_asks(8, max_tokens=100, offset=300):
                    nursery.start_soon(send_or_error, client, ask, outcomes)
            failed = [o for o in outcomes if isinstance(o, ControlError)]
            served = [o for o in outcomes if isinstance(o, Outcome)]
            assert failed, "decode-0 failed before it took any request"
            for error in failed:
                assert (error.code, error.message) == (
                    "replica_failed",
                    f"replica decode-0 failed: {INJECTED}",
                )
            assert_correct(tiny, served, transport=default_transport())
            assert {o.result.transfers[0].destination for o in served} <= {"decode-1"}
            landed_on_0 = {
                e["request_id"]
                for e in node.events("transfer_started")
                if e["destination"] == "decode-0" and e["replica"] == "decode-0"
            }
            assert {error.request_id for error in failed} == landed_on_0

            status = by_name(await client.status())["decode-0"]
            assert (status.state, status.last_error, status.used_blocks) == ("Inactive", INJECTED, 0)
            (failure,) = node.events("replica_failed")
            assert failure["replica"] == "decode-0" and failure["failed_requests"] == len(failed)
            assert [e["fault"] for e in node.events("fault_injected")] == ["fail_replica"]

            # The node serves on with decode-1, and decode-0 can be loaded again.
            again = [await send(client, ask) for ask in distinct_asks(3, max_tokens=4, offset=310)]
            assert_correct(tiny, again, transport=default_transport())
            assert {o.result.transfers[0].destination for o in again} == {"decode-1"}
            result = await client.transition("decode-0", "LoadingDecode")
            assert (result.previous, result.state) == ("Inactive", "LoadingDecode")
            await wait_states(client, {"decode-0": "Decode"})
            await client.lock("decode-1")
            revived = await send(client, distinct_asks(1, max_tokens=4, offset=320)[0])
            assert_correct(tiny, [revived], transport=default_transport())
            assert revived.result.transfers[0].destination == "decode-0"
            await client.unlock("decode-1")
            await wait_idle(client)

            # SIGTERM with requests in flight: they finish, then the node exits 0 (checked by the harness).
            draining: list[Outcome] = []
            async with trio.open_nursery() as nursery:
                launch(nursery, client, distinct_asks(3, max_tokens=40, offset=330), draining)
                await wait_status(
                    client,
                    lambda s: sum(by_name(s)[d].used_blocks for d in ("decode-0", "decode-1")) > 0,
                    "the requests decoding",
                )
                node.process.send_signal(signal.SIGTERM)
            assert_correct(tiny, draining, transport=default_transport())
        assert await trio.to_thread.run_sync(node.wait_exit) == 0, node.diagnosis()
        (stopping,) = node.events("node_stopping")
        assert (stopping["reason"], stopping["detail"], stopping["in_flight"]) == (
            "signal",
            "signal SIGTERM",
            3,
        )


async def test_a_request_no_replica_takes_fails_after_the_queue_wait(tmp_path: Path, tiny: Model) -> None:
    """prefill-0 fails at its first loop step, so no replica can prefill: a generate waits `--queue-wait`
    seconds, then fails with `overloaded` naming the replica, its state and its last error (before the
    deadline it waited until the client gave up: the demo hung so when a dtype bug failed every replica
    at load). Loaded again, prefill-0 serves."""
    injected = "InjectedFault: prefill-0: injected failure (fail_replica fault hook)"
    options = ("--replicas", "prefill=1,decode=1", "--queue-wait", "1.5")
    with node_process(tmp_path, *options, "--fault", "fail_replica:replica=prefill-0,after_steps=0") as node:
        async with node.client() as client:
            await wait_status(
                client,
                lambda s: (
                    by_name(s)["prefill-0"].last_error == injected
                    and by_name(s)["decode-0"].state == "Decode"
                ),
                "prefill-0 failed, decode-0 serving",
            )
            ask = Ask(input_ids=tuple(range(3, 20)), max_tokens=3, ignore_eos=True)
            with (
                deadline("the request refused after its queue wait", 30),
                pytest.raises(ControlError) as refused,
            ):
                await send(client, ask)
            assert (refused.value.code, refused.value.message) == (
                "overloaded",
                f"waited 1.5 s for a prefill replica to take it; prefill-0 Inactive (last error: {injected})",
            )
            await client.transition("prefill-0", "LoadingPrefill")
            await wait_states(client, {"prefill-0": "Prefill"})
            assert_correct(tiny, [await send(client, ask)], transport=default_transport())
            await wait_idle(client)


@pytest.mark.slow
async def test_requests_still_decoding_at_the_drain_deadline_get_their_final_reply(
    tmp_path: Path, tiny: Model
) -> None:
    """A shutdown whose drain deadline passes while requests decode: each still gets its one final reply,
    a result ending `cancelled` with the model's tokens so far (a review found the connections closed
    with those replies queued but unsent, so the clients saw the stream end instead)."""
    long_asks = [
        Ask(input_ids=ask.input_ids, max_tokens=8000, ignore_eos=True, stream=stream)
        for ask, stream in zip(distinct_asks(2, max_tokens=1, offset=600), (False, True), strict=True)
    ]
    with node_process(tmp_path, "--replicas", "prefill=1,decode=1", "--shutdown-drain-deadline", "1") as node:
        ended: list[Outcome] = []
        async with node.client() as client, node.client() as operator:
            await wait_serving(client)
            async with trio.open_nursery() as nursery:
                launch(nursery, client, long_asks, ended)
                await wait_status(
                    client,
                    lambda s: by_name(s)["decode-0"].used_blocks == sum(map(reserved_blocks, long_asks)),
                    "both requests decoding",
                )
                assert (await operator.shutdown()).in_flight == 2
        assert sorted(o.result.finish_reason for o in ended) == ["cancelled", "cancelled"]
        for outcome in ended:
            assert 0 < len(outcome.result.token_ids) < 8000
            assert_model_tokens(tiny, outcome.ask, outcome.result.token_ids)
        assert await trio.to_thread.run_sync(node.wait_exit) == 0, node.diagnosis()
