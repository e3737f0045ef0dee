"""What a replica's failure leaves behind is answered and logged. A command that reaches a replica as it
fails gets `replica_failed` at once, not silence until its asker's timeout (a review finding: the supervisor gave the replica a fresh inbox and the commands in the
old one were never answered, so a `lock` op waited 30 s and then failed with an internal error).

A node served in the test's own trio run (`tests.epd.inprocess`), so a helper's completion can fail the
replica's loop — the way a helper's error reaches it — while a command waits in its inbox, or while a
KV transfer lands in it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from engine.client import ControlClient, ControlError
from messages.commands import Lock
from replicas.inbox import CommandRefused, Completed, Envelope, new_command_id
from tests.epd.inprocess import served_node
from tests.epd.node import wait_serving
from tests.waiting import deadline, wait_until


async def test_a_command_posted_as_the_replica_fails_is_refused_with_its_failure(tmp_path: Path) -> None:
    async with served_node(tmp_path) as served, ControlClient.connect(served.address) as client:
        await wait_serving(client)
        decode = served.node.directory["decode-0"]
        waiting = Envelope(Lock(command_id=new_command_id(), reason="manual"))

        def fail(_: Any) -> None:
            decode.post(waiting)  # arrives while the loop raises: it is left in the inbox
            raise RuntimeError("a helper's step failed")

        decode.post(Completed(fail))
        with deadline("the Lock posted as the replica failed being answered", 10):
            await waiting.done.wait()
        assert isinstance(waiting.error, CommandRefused)
        assert waiting.error.code == "replica_failed"
        assert str(waiting.error) == (
            "decode-0 failed before it handled the Lock command (RuntimeError: a helper's step failed)"
        )
        # The restarted replica answers commands again (it is Inactive until commanded to load).
        status = await client.lock("decode-0")
        assert status.lock_reasons == ["manual"]
        assert decode.last_error == "RuntimeError: a helper's step failed"


async def test_a_kv_transfer_cut_short_by_its_replica_failing_is_logged_as_ended(tmp_path: Path) -> None:
    """The decode replica fails while a KV transfer lands in it (the sender stalls before writing): the
    transfer's `transfer_started` gets its `transfer_finished` (failed, aborted), so the node's metrics
    hold no transfer open for good (a review finding: the replica's cancellation skipped it)."""
    async with (
        served_node(tmp_path, "--fault", "stall_sender:replica=prefill-0,seconds=5") as served,
        ControlClient.connect(served.address) as client,
    ):
        await wait_serving(client)
        decode = served.node.directory["decode-0"]
        outcome: list[str] = []

        async def generate() -> None:
            try:
                await client.generate_result(prompt="cut short", max_tokens=4, request_id="cut-short")
            except ControlError as exc:
                outcome.append(exc.code)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(generate)
            await wait_until(
                lambda: any(e["replica"] == "decode-0" for e in served.events("transfer_started")),
                "a KV transfer into decode-0 starting",
                30,
            )

            def fail(_: Any) -> None:
                raise RuntimeError("the decode replica failed mid-transfer")

            decode.post(Completed(fail))
        # Whichever side ends the request first: the sender's transfer failing, or the supervisor.
        assert outcome in (["transfer_failed"], ["replica_failed"])
        started = [e for e in served.events("transfer_started") if e["replica"] == "decode-0"]
        finished = [e for e in served.events("transfer_finished") if e["replica"] == "decode-0"]
        assert [(e["transfer_id"], e["status"], e["reason"]) for e in finished] == [
            (started[0]["transfer_id"], "failed", "aborted")
        ]
        assert served.node.service.aggregator.unfinished_transfers() == 0
