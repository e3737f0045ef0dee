"""Lock (architecture §6) on a real node with three decode replicas (`tiny_tcp_node`): the controller's reject-KV
loop locks the overloaded one, new migrations avoid it, the loop unlocks it when the skew is gone, and it
never clears a manual lock.

Skew: with decode-1 and decode-2 locked by hand, one long request (max_tokens 20000, so decode-0 reserves
1252 of its 2048 blocks — more than half its capacity and more than twice the others' mean of 0) lands
on decode-0. Cancelling it removes the skew.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import trio

from engine.client import ControlError
from replicas.model import Model
from tests.node.harness import (
    NodeProcess,
    by_name,
    default_transport,
    node_process,
    wait_idle,
    wait_serving,
    wait_status,
)
from tests.node.workload import Ask, Outcome, assert_correct, distinct_asks, launch, reserved_blocks, send


async def test_controller_locks_the_overloaded_decode_replica_and_keeps_manual_locks(
    tiny_tcp_node: NodeProcess, tiny: Model
) -> None:
    node = tiny_tcp_node
    skew = Ask(input_ids=tuple(range(1, 21)), max_tokens=20000, ignore_eos=True)
    skew_id = f"skew-{uuid.uuid4().hex[:8]}"
    skewed: list[Outcome] = []
    short: list[Outcome] = []
    async with node.client() as client:
        await wait_serving(client)
        await wait_idle(client)
        await client.lock("decode-1")
        await client.lock("decode-2")
        async with trio.open_nursery() as nursery:

            async def long_request() -> None:
                skewed.append(await send(client, skew, request_id=skew_id))

            nursery.start_soon(long_request)
            status = await wait_status(
                client,
                lambda s: "controller" in by_name(s)["decode-0"].lock_reasons,
                "the controller locking decode-0",
            )
            assert by_name(status)["decode-0"].used_blocks == reserved_blocks(skew) == 1252
            await client.unlock("decode-1")
            await client.unlock("decode-2")
            status = await client.status()
            locks = {r.name: (r.locked, r.lock_reasons) for r in status.replicas if r.role == "decode"}
            assert locks == {
                "decode-0": (True, ["controller"]),
                "decode-1": (False, []),
                "decode-2": (False, []),
            }
            # A manual unlock does not clear the controller's lock; a manual lock joins it.
            unlocked = await client.unlock("decode-0")
            assert (unlocked.locked, unlocked.lock_reasons) == (True, ["controller"])
            locked = await client.lock("decode-0")
            assert (locked.locked, locked.lock_reasons) == (True, ["controller", "manual"])

            # New migrations avoid the locked replica.
            async with trio.open_nursery() as senders:
                launch(senders, client, distinct_asks(6, max_tokens=3, offset=90), short)
            destinations = {o.result.transfers[0].destination for o in short}
            assert destinations <= {"decode-1", "decode-2"} and destinations, destinations

            # The skew goes away: the loop clears its own lock, not the manual one.
            cancelled = await client.cancel(skew_id)
            assert cancelled.request_id == skew_id
            status = await wait_status(
                client,
                lambda s: by_name(s)["decode-0"].lock_reasons == ["manual"],
                "the controller unlocking decode-0 (the manual lock staying)",
            )
            assert by_name(status)["decode-0"].locked
        assert skewed[0].result.finish_reason == "cancelled"
        assert 0 < len(skewed[0].result.token_ids) < skew.max_tokens
        assert_correct(tiny, short)
        ids = {o.result.request_id for o in short}
        assert not [
            e
            for e in node.events("transfer_started")
            if e["request_id"] in ids and e["destination"] == "decode-0"
        ]
        decode_0 = [
            (e["event"], e["reason"], e.get("still_locked"))
            for e in node.events("replica_locked", "replica_unlocked")
            if e["replica"] == "decode-0"
        ]
        # (The manual unlock found no manual lock to clear: no event.) The loop ran after the manual
        # lock was set — it cleared its own reason — and left the manual one.
        assert decode_0[-3:] == [
            ("replica_locked", "controller", None),
            ("replica_locked", "manual", None),
            ("replica_unlocked", "controller", True),
        ]
        unlocked = await client.unlock("decode-0")
        assert (unlocked.locked, unlocked.lock_reasons) == (False, [])
        await wait_idle(client)


async def test_a_request_no_decode_replica_takes_fails_overloaded_after_the_migration_wait(
    tmp_path: Path, tiny: Model
) -> None:
    """With every decode replica locked, a prefilled request waits `--migration-wait` seconds for one to
    take its KV, then fails `overloaded`, and its KV blocks return to the prefill replica's pool."""
    ask = distinct_asks(1, max_tokens=4, offset=700)[0]
    with node_process(tmp_path, "--replicas", "prefill=1,decode=1", "--migration-wait", "0.5") as node:
        async with node.client() as client:
            await wait_serving(client)
            await client.lock("decode-0")
            with pytest.raises(ControlError) as refused:
                await send(client, ask, request_id="nobody-decodes")
            assert refused.value.code == "overloaded"
            assert refused.value.message == (
                "no decode replica took the KV of request nobody-decodes within 0.5 s "
                "(all locked, full or not decoding)"
            )
            await wait_idle(client)
            await client.unlock("decode-0")
            served: list[Outcome] = []
            async with trio.open_nursery() as nursery:
                launch(nursery, client, [ask], served)
            assert_correct(tiny, served, transport=default_transport())
