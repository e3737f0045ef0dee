"""The `Link` interface every transport backend implements (inproc, tcp, ucx, cuda-ipc).

A link joins one receiver endpoint to one sender endpoint. It carries control messages both ways and
bulk writes from the sender into the receiver's blocks, **in one order**: a control message sent after a
`write` returned is handled by the receiver after that write's bytes have landed. That ordering is what
makes `ChunkDone` (sent after the bytes) and `AbortAck` (sent after the last write) meaningful.

Completion and fences:
- `write` returns when the source rows may be reused and the bytes are on their way in order; when it
  returns, no later control message can overtake them.
- `quiesce()` returns once no write through this link can still land in the receiver's memory (tcp: the
  reader has stopped; inproc: copies running in worker threads have finished). A closed link that has
  quiesced is a fence (architecture §5.7).

The receiving side's bytes go through a `LinkHandler` (the endpoint): it names the memory a bulk frame
lands in, or None to discard it (an aborted round), so bytes are never written where no grant stands.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Final, Literal, NoReturn, Protocol

import trio

from messages.transfer import ChunkDone, Heartbeat, PeerMessage
from transport.bulk.write import BulkWrite
from transport.config import TransferConfig
from transport.errors import LinkBroken, LinkError
from transport.faults import FaultPlan
from transport.memory.storage import PoolStorage

# After its last activity a network link's reader polls this long (real time: a mock Trio clock stands
# still while a task polls) before it sleeps on its file descriptor: a transfer's messages come in bursts
# a few hundred µs apart, and a message to a sleeping peer costs both ends a wake-up (about 100 µs
# together on a VM, several times per transfer).
POLL_SECONDS: Final = 0.0005

Role = Literal["receiver", "sender"]


class Landing(Protocol):
    """Where one transfer's bytes may land on the receiving side (a receiver session)."""

    storage: PoolStorage

    def claim(self, round: int, buffer: str, segments: Sequence[tuple[int, int]]) -> bool:
        """True if every `(dst_row, rows)` segment of flat rows of `buffer` is granted to `round`, and
        the round is still open.

        False means "discard these bytes": the round is over or aborted, or the peer broke the
        protocol (then the transfer fails; the link lives). Claiming counts as progress.
        """
        ...


class LinkHandler(Protocol):
    """What a link calls on its endpoint."""

    async def on_message(self, link: Link, message: PeerMessage) -> None: ...

    def landing(self, link: Link, landing_key: int) -> Landing | None: ...

    def on_closed(self, link: Link, error: LinkError) -> None: ...


class LinkOwner(LinkHandler, Protocol):
    """What a backend needs of the endpoint it makes links for (`transport.endpoint.TransferEndpoint`):
    its name, pool storage, settings and faults, and the nursery its link tasks run in."""

    name: str
    storage: PoolStorage
    config: TransferConfig
    faults: FaultPlan

    @property
    def nursery(self) -> trio.Nursery: ...


def more_rounds_follow(trailer: PeerMessage | None) -> bool:
    """Whether `trailer` is the `ChunkDone` of a round that does not end its transfer: its write may
    return before its bytes went out (see `Link.write`)."""
    return isinstance(trailer, ChunkDone) and trailer.offset + trailer.tokens < trailer.total_tokens


class Link(abc.ABC):
    """One end of a link. `role` is this end's role; `peer` is the far endpoint's name once known.

    `lands_in_named_storage`: the link writes each bulk frame into its landing's `storage`, whatever
    storage the receive named (inproc, tcp, ucx); False where the sender writes into the receiving
    pool's memory it mapped at the handshake (cuda-ipc), so a receive must land in that pool."""

    lands_in_named_storage: bool = True

    def __init__(self, *, link_id: str, local: str, role: Role, handler: LinkHandler) -> None:
        self.link_id = link_id
        self.local = local
        self.role: Role = role
        self.handler = handler
        self.peer: str | None = None
        self.error: LinkError | None = None
        self.closed = trio.Event()
        self.ready = trio.Event()  # handshake finished (either outcome)
        self.refusal: str | None = None

    @property
    def is_closed(self) -> bool:
        return self.error is not None

    def describe(self) -> str:
        return f"{self.local} ⇄ {self.peer or '?'} ({self.link_id})"

    def raise_closed(self) -> NoReturn:
        """Raise (a copy of) the error the link closed with; only on a closed link."""
        assert self.error is not None
        raise type(self.error)(str(self.error))

    @abc.abstractmethod
    async def send(self, message: PeerMessage) -> None:
        """Queue one control message in link order. Raises `LinkError` once closed."""

    @abc.abstractmethod
    async def write(self, bulk: BulkWrite, trailer: PeerMessage | None = None) -> int:
        """Move one round's bytes, then `trailer` (the round's `ChunkDone`) in link order; returns the
        bytes that went out. Raises `LinkError` once closed.

        Cancellation takes effect between frames (tcp) or not at all while a worker-thread copy runs
        (inproc): a frame is never left half-written on a link that stays open. A trailer goes out
        only after every byte of the write (tcp: in the same `sendmsg` batch as the last frames).
        A write whose trailer does not end its transfer may return before its bytes went out (ucx
        sends in flight, inproc rounds on the copy lane): the next message still follows them, and
        `settle` waits for them.
        """

    @abc.abstractmethod
    async def run(self) -> None:
        """The link's reader (and, on networks, heartbeats). Runs in the endpoint's nursery until the
        link closes; never cancelled by a transfer. Returns after calling `handler.on_closed`."""

    @abc.abstractmethod
    def close(self, error: LinkError) -> None:
        """Close now (idempotent); the first error is the one reported."""

    @abc.abstractmethod
    async def quiesce(self) -> None:
        """Return once no write through this link can still land (see the module docstring)."""

    async def settle(self) -> None:
        """Return once no earlier `write` still reads the sender's rows (sending side): the writes of
        rounds that do not end their transfer may return before their bytes went out (ucx: each send
        waited for within `link_timeout`, or the link fails; inproc: the copy lane). On tcp and
        cuda-ipc a write is done when it returns, so there is nothing to wait for. Never raises;
        shielded."""
        return


async def keep_alive(
    link: Link,
    config: TransferConfig,
    last_received: Callable[[], float],
    last_sent: Callable[[], float],
    may_send: Callable[[], bool] = lambda: True,
) -> None:
    """A network link's liveness (architecture §5): a `Heartbeat` after `heartbeat_interval` without sending
    (when `may_send`: not while a write holds the link), and the link closed as broken after
    `link_timeout` without receiving anything. Returns once it closed the link or a send failed; the
    link's reader cancels it otherwise."""
    interval, seq = config.heartbeat_interval, 0
    while True:
        await trio.sleep(interval / 2)
        now = trio.current_time()
        quiet = now - last_received()
        if quiet > config.link_timeout:
            link.close(LinkBroken(f"link {link.describe()}: nothing received for {quiet:.1f} s"))
            return
        if now - last_sent() >= interval and may_send():
            seq += 1
            try:
                await link.send(Heartbeat(link_id=link.link_id, seq=seq))
            except LinkError:
                return
