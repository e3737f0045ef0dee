"""A command that reaches a replica as it fails gets `replica_failed` at once, not silence until its
asker's timeout (a review finding: the supervisor gave the replica a fresh inbox and the commands in the
old one were never answered, so a `lock` op waited 30 s and then failed with an internal error).

A node served in the test's own trio run (`tests.epd.inprocess`), so a helper's completion can fail the
replica's loop — the way a helper's error reaches it — while a command waits in its inbox.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from engine.client import ControlClient
from messages.commands import Lock
from replicas.inbox import CommandRefused, Completed, Envelope, new_command_id
from tests.epd.inprocess import served_node
from tests.epd.node import wait_serving


async def test_a_command_posted_as_the_replica_fails_is_refused_with_its_failure(tmp_path: Path) -> None:
    async with served_node(tmp_path) as served, ControlClient.connect(served.address) as client:
        await wait_serving(client)
        decode = served.node.services.replicas["decode-0"]
        waiting = Envelope(Lock(command_id=new_command_id(), reason="manual"))

        def fail(_: Any) -> None:
            decode.post(waiting)  # arrives while the loop raises: it is left in the inbox
            raise RuntimeError("a helper's step failed")

        decode.post(Completed(fail))
        with trio.fail_after(10):
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
