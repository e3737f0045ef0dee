"""A sending endpoint in its own process, for the two-process tests: `python -m tests.transport.sender_process`.

Reads one JSON object on stdin (`hidden`, `block_size`, `seed`, `transfers` = {transfer id: tokens},
optional `faults`, `config`, `transport` — tcp, ucx or cuda-ipc — and `device`), prints `{"address": ...}`, sends the first `tokens` tokens of its source
for each listed transfer when its grant comes, reports each outcome as a JSON line, and exits when stdin
closes. With `give_up_after_round` = k the owner cancels each `send` once it wrote round k (reporting
`{"giving_up": id}` first) and, the moment `send` returns, overwrites its whole source: what an owner
that reuses the blocks does. With
`stop_after_posting_round` = k (ucx) the process stops itself (SIGSTOP) right after posting round k's first
frame, before its UCX worker progresses again: it owes the receiver that frame's bytes and cannot write
them. Its source is `harness.Source(layout, max tokens, seed)`, so the test process rebuilds the
expected bytes without any of them crossing a pipe.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import msgspec
import structlog
import torch
import trio

from tests.transport.harness import Source, embedding_layout, listen
from tests.waiting import wait_until
from transport.bulk.write import BulkWrite
from transport.config import TransferConfig
from transport.endpoint import open_endpoint
from transport.errors import TransferError
from transport.faults import FaultPlan
from transport.links.ucx.link import UcxLink
from transport.protocol.sender import SendSession


def stop_after_posting(round_number: int) -> None:
    """The `stop_after_posting_round` fault, by wrapping `UcxLink._post_frames` and `_post_reads` (a
    read group) in this process."""

    def stopping(post: Any) -> Any:
        def post_then_stop(link: UcxLink, bulk: BulkWrite, *frames_and_how: Any) -> Any:
            posted = post(link, bulk, *frames_and_how)
            if bulk.round == round_number:
                # One progress call pushes out what UCX queued (the rendezvous requests); the receiver's
                # answer takes far longer than this to come back, so the bytes are never written.
                link._worker._worker.progress()
                os.kill(os.getpid(), signal.SIGSTOP)
            return posted

        return post_then_stop

    UcxLink._post_frames = stopping(UcxLink._post_frames)  # type: ignore[method-assign]
    UcxLink._post_reads = stopping(UcxLink._post_reads)  # type: ignore[method-assign]


async def main() -> None:
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # stdout carries replies
    params = json.loads(sys.stdin.readline())
    if params.get("stop_after_posting_round") is not None:
        stop_after_posting(params["stop_after_posting_round"])
    transfers: dict[str, int] = params["transfers"]
    layout = embedding_layout(params["block_size"], params["hidden"])
    source = Source(layout, max(transfers.values()), params["seed"], device=params.get("device", "cpu"))
    faults = msgspec.convert(params.get("faults", {}), FaultPlan)
    config = msgspec.convert(params.get("config", {}), TransferConfig)
    async with open_endpoint(
        "sender-process", source.storage, source.pool, config=config, faults=faults
    ) as endpoint:
        print(json.dumps({"address": await listen(endpoint, params.get("transport", "tcp"))}), flush=True)

        give_up_after_round: int | None = params.get("give_up_after_round")
        gave_up: set[str] = set()

        async def give_up(session: SendSession, owner: trio.CancelScope) -> None:
            assert give_up_after_round is not None
            await wait_until(
                lambda: session.report().rounds > give_up_after_round,
                f"the sender writing round {give_up_after_round} of {session.transfer_id}",
                interval=0.005,
            )
            gave_up.add(session.transfer_id)
            print(json.dumps({"giving_up": session.transfer_id}), flush=True)
            owner.cancel()

        async def send(transfer_id: str, tokens: int) -> None:
            try:
                async with endpoint.open_send(transfer_id) as session, trio.open_nursery() as owner:
                    if give_up_after_round is not None:
                        owner.start_soon(give_up, session, owner.cancel_scope)
                    report = await session.send(source.ids, total_tokens=tokens)
                    owner.cancel_scope.cancel()
                if transfer_id in gave_up:
                    for tensor in source.storage.tensors.values():
                        tensor.view(torch.uint8).fill_(0xA5)
                    print(json.dumps({"gave_up": transfer_id}), flush=True)
                else:
                    print(json.dumps({"sent": transfer_id, "rounds": report.rounds}), flush=True)
            except TransferError as exc:
                print(json.dumps({"failed": transfer_id, "reason": exc.reason.value}), flush=True)

        async with trio.open_nursery() as nursery:
            for transfer_id, tokens in transfers.items():
                nursery.start_soon(send, transfer_id, tokens)
            await trio.to_thread.run_sync(sys.stdin.read)
            nursery.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(main)
