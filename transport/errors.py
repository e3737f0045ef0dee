"""Exceptions of the transfer layer, and the node error code each failure maps to.

Exact classes, so callers catch what they mean:
- `TransferFailed` / `TransferTimeout`: one transfer ended `Failed`; `TransferTimeout` only for the memory
  pressure deadline (node code `transfer_timeout`), everything else is `TransferFailed`
  (`transfer_failed`). Both carry the side's `TransferReport`.
- `HandshakeRefused`: the peer refused the link (layout, block size, protocol version).
- `LinkClosed`: the link was closed on purpose or by the peer; `LinkBroken`: it failed (malformed frame,
  missed heartbeats, socket error). Both are `LinkError`.
"""

from __future__ import annotations

from typing import Final, Literal, final

from messages.transfer import FailureReason, TransferReport

# The node error codes (`messages.control.ErrorCode`) a failed transfer maps to.
TransferCode = Literal["transfer_failed", "transfer_timeout"]
ERROR_CODES: Final[dict[FailureReason, TransferCode]] = {
    FailureReason.MEMORY_PRESSURE: "transfer_timeout",
    FailureReason.NO_PROGRESS: "transfer_failed",
    FailureReason.LINK_LOST: "transfer_failed",
    FailureReason.ABORTED: "transfer_failed",
    FailureReason.PROTOCOL_ERROR: "transfer_failed",
    FailureReason.CORRUPTED: "transfer_failed",
    FailureReason.NO_SENDER: "transfer_failed",
    FailureReason.TOO_LARGE: "transfer_failed",
}


def error_code(reason: FailureReason) -> TransferCode:
    """The node's error code (architecture §7) for a failure reason."""
    return ERROR_CODES[reason]


class TransferError(Exception):
    """A transfer ended `Failed`. Use the exact subclasses."""

    def __init__(self, report: TransferReport) -> None:
        assert report.reason is not None
        self.report = report
        self.reason: FailureReason = report.reason
        self.code: TransferCode = error_code(report.reason)
        super().__init__(f"transfer {report.transfer_id!r} failed ({report.reason.value}): {report.detail}")


@final
class TransferFailed(TransferError):
    """Node code `transfer_failed`."""


@final
class TransferTimeout(TransferError):
    """Node code `transfer_timeout`: no blocks for a grant before the memory pressure deadline."""


def transfer_error(report: TransferReport) -> TransferError:
    """The exact exception for a failed report."""
    assert report.reason is not None
    if error_code(report.reason) == "transfer_timeout":
        return TransferTimeout(report)
    return TransferFailed(report)


@final
class HandshakeRefused(Exception):
    """The peer refused the link; the message names both values (`block_size mismatch: sender 128, …`)."""


class LinkError(Exception):
    """A link can no longer carry messages."""


@final
class LinkClosed(LinkError):
    """Closed on purpose, by either side."""


@final
class LinkBroken(LinkError):
    """Failed: socket error, malformed frame, missed heartbeats."""


@final
class ProtocolViolation(Exception):
    """A peer message that breaks the protocol for one transfer (the transfer fails, the link lives)."""
