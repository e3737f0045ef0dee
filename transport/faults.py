"""Fault injection for tests and the node's fault hooks (architecture §7). Off by default.

An endpoint is given one `FaultPlan` — the injected object its parts call at fixed points, which does
nothing with the default plan (`NO_FAULTS`): a sending session calls `before_round` and `corrupts`, and
each sending link keeps a `WriteFaults` (`writes()`) that its bulk writes report to. No part reads a
fault's fields itself. `transfer_id` narrows a fault to one transfer (None: every transfer of the
endpoint).

- `stall_before_round` / `stall_seconds`: the sender sleeps before writing that round (a stalled sender;
  the receiver's progress deadline is what ends it).
- `drop_link_after_bytes`: the sender's link is torn down abruptly once it has written that many bulk
  bytes (TCP: the socket is closed mid-frame; inproc: the link breaks).
- `corrupt_round`: the sender flips one byte of that round's data as it goes out (the receiver notices
  only with `TransferConfig.checksums`).
- `malformed_frame_after_bytes`: the sender puts a garbage frame on its link once it has written that
  many bulk bytes (TCP only; the receiver closes that link with a logged reason).
- `short_message_after_bytes`: once it has written that many bulk bytes, the sender sends the last
  message of each frame (or bundle) a byte short of what its descriptor announced (UCX only; where the
  receiver lands it in host memory the receive fails, and the receiver closes that link naming both
  lengths; a receive into GPU memory does not notice).
- `misaddressed_read_after_bytes`: once it has written that many bulk bytes, the sender describes its
  read groups (`transport.links.ucx.reads`) at an address it does not have (UCX, with a receiver that reads;
  the receiver's read fails, and it closes that link naming the kernel's error).
"""

from __future__ import annotations

from typing import final

import msgspec
import trio


class FaultPlan(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    transfer_id: str | None = None
    stall_before_round: int | None = None
    stall_seconds: float = 3600.0
    drop_link_after_bytes: int | None = None
    corrupt_round: int | None = None
    malformed_frame_after_bytes: int | None = None
    short_message_after_bytes: int | None = None
    misaddressed_read_after_bytes: int | None = None

    def applies_to(self, transfer_id: str) -> bool:
        return self.transfer_id is None or self.transfer_id == transfer_id

    @property
    def active(self) -> bool:
        return self != NO_FAULTS

    async def before_round(self, transfer_id: str, round: int, ended: trio.Event) -> None:
        """A sender is about to write `round` of `transfer_id`: `stall_before_round` holds it there for
        `stall_seconds`, or until the transfer `ended`."""
        if self.stall_before_round == round and self.applies_to(transfer_id):
            with trio.move_on_after(self.stall_seconds):
                await ended.wait()

    def corrupts(self, transfer_id: str, round: int) -> bool:
        """Whether the sender flips a byte of `round` of `transfer_id` as it goes out (`corrupt_round`)."""
        return self.corrupt_round == round and self.applies_to(transfer_id)

    def writes(self) -> WriteFaults:
        """The write hooks of one sending link."""
        return WriteFaults(self)


NO_FAULTS = FaultPlan()


@final
class WriteFaults:
    """A sending link's `FaultPlan` as its bulk bytes go out (tcp, ucx): each fault falls due once the
    link has written its number of bytes (`written`, which the link adds to)."""

    def __init__(self, plan: FaultPlan) -> None:
        self.plan, self.written, self._malformed_sent = plan, 0, False

    def drop_due(self, length: int) -> int | None:
        """`drop_link_after_bytes`, when writing `length` more bytes reaches it."""
        at = self.plan.drop_link_after_bytes
        return at if at is not None and self.written + length >= at else None

    def malformed_due(self) -> bool:
        """True once, when the garbage frame is due."""
        at = self.plan.malformed_frame_after_bytes
        if at is None or self._malformed_sent or self.written < at:
            return False
        self._malformed_sent = True
        return True

    @property
    def shortens(self) -> bool:
        """Whether some message of this link is to go a byte short (its bytes are then sent, not read)."""
        return self.plan.short_message_after_bytes is not None

    def short_due(self) -> bool:
        at = self.plan.short_message_after_bytes
        return at is not None and self.written >= at

    def misaddressed_due(self) -> bool:
        at = self.plan.misaddressed_read_after_bytes
        return at is not None and self.written >= at

    def wrote(self, length: int) -> int | None:
        """`length` more bytes were written (inproc, cuda-ipc: the copy is the write); returns
        `drop_link_after_bytes` when the link has now written that many (it is to be dropped)."""
        self.written += length
        at = self.plan.drop_link_after_bytes
        return at if at is not None and self.written >= at else None
