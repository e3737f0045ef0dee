"""A replica's inbox (architecture §6): what reaches the actor, drained a batch at a time.

Commands (`Envelope`), completions of its helpers (`Completed`) and wake-ups (None) share one unbounded
channel, so posting never blocks and never fails while the inbox is open. `batch` waits for the next
item and takes everything already there with it; the main loop handles a batch's commands before its
completions. The transfer protocol's sender-bound messages arrive on a second channel (`sender`, given
to the transfer endpoints) and are forwarded into the inbox as commands.

When a run ends, the commands it never handled — still in the channel, or left behind the one that
failed it (`leave`) — are refused with `replica_failed` (`refuse_unhandled`), so whoever waits on one
hears at once; everything else in it belongs to the run that ended and is dropped. `renew` gives the
next run fresh channels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, final

import trio

from replicas.inbox import CommandRefused, Completed, Envelope, InboxItem
from transport.endpoint import SenderDelivery


@final
class Inbox:
    """See the module docstring. `name` is the replica's (for the refusals' messages)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._unhandled: list[Envelope] = []
        self.renew()

    def renew(self) -> None:
        """Fresh channels (after `refuse_unhandled`): the next run's."""
        self._send, self._receive = trio.open_memory_channel[InboxItem](math.inf)
        self.sender, self._sender_receive = trio.open_memory_channel[SenderDelivery](math.inf)

    def post(self, item: InboxItem = None) -> None:
        self._send.send_nowait(item)

    async def batch(self) -> tuple[list[Envelope], list[Completed]]:
        """Wait for the next item; return it with every item already queued, split into commands and
        completions (wake-ups only wake). Cancellation: nothing is taken when cancelled while waiting."""
        items = [await self._receive.receive()]
        while True:
            try:
                items.append(self._receive.receive_nowait())
            except trio.WouldBlock:
                break
        envelopes = [i for i in items if isinstance(i, Envelope)]
        return envelopes, [i for i in items if isinstance(i, Completed)]

    def leave(self, envelopes: Sequence[Envelope]) -> None:
        """Commands of a batch that a failure left unhandled (refused by `refuse_unhandled`)."""
        self._unhandled.extend(envelopes)

    async def forward_sender_messages(self) -> None:
        """Forward the transfer protocol's sender-bound messages into the inbox, until cancelled."""
        async for delivery in self._sender_receive:
            self.post(Envelope(delivery.message, link=delivery.link))

    def refuse_unhandled(self, how: Literal["stopped", "failed"], why: str | None) -> None:
        """Refuse, with `replica_failed`, every command the run left unhandled (see the module
        docstring); `why`: the replica's last error, if any."""
        unhandled, self._unhandled = self._unhandled, []
        while True:
            try:
                item = self._receive.receive_nowait()
            except (trio.WouldBlock, trio.ClosedResourceError, trio.EndOfChannel):
                break
            if isinstance(item, Envelope):
                unhandled.append(item)
        for envelope in unhandled:
            if envelope.done.is_set():
                continue
            envelope.error = CommandRefused(
                "replica_failed",
                f"{self._name} {how} before it handled the {type(envelope.command).__name__} command "
                f"({why or 'its task ended'})",
            )
            envelope.done.set()
