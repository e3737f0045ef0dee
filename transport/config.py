"""Typed configuration of the transfer layer (one msgspec Struct, decoded from the node's config).

Every wait that can hang has a deadline here. Sizes are in blocks of the pool the endpoint serves.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from transport.auth.credentials import LinkAdmission

Positive = Annotated[int, msgspec.Meta(ge=1)]
Seconds = Annotated[float, msgspec.Meta(gt=0)]
# Who copies a UCX transfer's bytes into the receiver's rows, between processes of one host.
UcxCopies = Literal["receiver", "mixed", "sender", "cma"]


class TransferConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Knobs of one endpoint (architecture §4-§5).

    - `default_grant_blocks`: round 0's grant when the receiver does not know the length (seeds: 8 blocks
      of 128 tokens = 1024 tokens).
    - `round_cap_blocks`: most blocks granted per round (None: unlimited). The knob that forces k rounds.
    - `window`: grants kept outstanding, so the sender never waits a round trip (1 = the seeds' design).
    - `progress_timeout`: a non-terminal transfer with no byte or message for this long fails
      (`no_progress`). Waiting sides send `StatusUpdate` every third of it, so queued work is not a stall.
    - `pressure_timeout`: how long a grant may wait for free blocks before `transfer_timeout`.
    - `heartbeat_interval` / `link_timeout`: a quiet link sends a heartbeat; a link that received
      nothing for `link_timeout` is broken.
    - `handshake_timeout`: connecting and the Hello exchange.
    - `fence_timeout`: how long a receiver waits for the sender's `AbortAck` before it tears the link
      down (which is also a fence) to get quarantined blocks back.
    - `orphan_timeout`: how long a sender endpoint keeps grants for a transfer no session has opened.
    - `checksums`: senders put a CRC-32 of each round's bytes in `ChunkDone`; receivers verify it
      (CPU storage only; costs a pass over the bytes).
    - `inproc_thread_bytes`: inproc rounds at least this large are copied in a worker thread, so the
      event loop keeps serving other replicas meanwhile.
    - `ucx_copies`: over UCX, from a sender process on this host (`transport.links.ucx.landing`):
      `"cma"` (the default): the receiver reads every piece of at least 16 KiB from the sender's memory itself
      (every piece of a write with at most 64 smaller ones, `transport.links.ucx.reads.reads_of`), a round's
      scattered pieces in a few `process_vm_readv` calls (`transport.links.ucx.reads`; where the kernel
      refuses it, or the pool is on a GPU, "mixed"); `"mixed"`: the receiver reads each direct piece through
      UCX's own rendezvous (what UCX does for any contiguous receive); in both, bundles of smaller rows land
      straight in their rows from UCX's shared-memory fragments; `"receiver"`: as "mixed", but those bundles
      land in a host chunk the receiver unpacks, so no block ever waits for the sender process; `"sender"`:
      the sender writes the direct pieces into the rows as well (scattered receives), off the receiver's
      thread.
    - `admission`: with the cluster secret, every tcp and ucx link opens with its challenge–response
      before the §5.1 handshake; a link that does not prove the secret is closed before any grant and
      logged (`transfer.link_refused`). None: links are not authenticated.
    - `ucx_read_lanes`: with `"cma"`, how many threads read a large call together (the receiver's own and
      `ucx_read_lanes - 1` of Trio's thread cache; `transport.links.ucx.cma.read`). 1: the receiver's only.
    """

    default_grant_blocks: Positive = 8
    round_cap_blocks: Positive | None = None
    window: Positive = 4
    progress_timeout: Seconds = 30.0
    pressure_timeout: Seconds = 10.0
    heartbeat_interval: Seconds = 1.0
    link_timeout: Seconds = 5.0
    handshake_timeout: Seconds = 5.0
    fence_timeout: Seconds = 5.0
    orphan_timeout: Seconds = 30.0
    checksums: bool = False
    inproc_thread_bytes: Positive = 4 * 1024 * 1024
    ucx_copies: UcxCopies = "cma"
    ucx_read_lanes: Annotated[int, msgspec.Meta(ge=1, le=64)] = 2
    admission: LinkAdmission | None = None

    def __post_init__(self) -> None:
        if self.link_timeout <= self.heartbeat_interval:
            raise ValueError(
                f"link_timeout ({self.link_timeout} s) must exceed heartbeat_interval "
                f"({self.heartbeat_interval} s)"
            )
