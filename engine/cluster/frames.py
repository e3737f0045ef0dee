"""What a member does with each frame it receives from a peer (`ClusterMember`, docs/cluster.md).

An answer to one of this node's own `ask`s is delivered whatever the lease (its correlation id matches
it). A frame addressed to an earlier incarnation of this node (`PeerFrame.to_lease`, set and not this
node's lease now — or this node's lease, once it was lost and before a new one is taken) is not acted on: its sender ended what it shared with that incarnation when it saw the
new lease — a `Submit` then would start a request its origin already failed, and hold its blocks for
nobody — so a `Submit` is answered `Returned`, anything else dropped (logged). Any other frame counts
only under the lease its sender is known under (`engine.cluster.books.incarnations`): then it is
dispatched by type, what it says of a request to the books (`engine.cluster.books.requests`). Under
another lease it is:
- a command (`RunCommand`) from a known node: handled, and refused `stale_lease` if it acts on a
  reservation or a lock (`engine.cluster.commands`);
- a `Submit` from a known node: returned at once (`Returned`), so the sender routes the request again;
- anything else, or from a node not known yet: held until the sender's record under that lease arrives —
  the watch may lag the sender by a moment, and the first report of a new incarnation names its endpoints
  (`release`) — and dropped after `HELD_SECONDS` (then it was an old incarnation's).

Runs on the Trio thread; tasks it starts (a command served, a forwarded op) run in the member's nursery.
"""

from __future__ import annotations

from typing import Final, Protocol, assert_never, final

import structlog
import trio

from engine.cluster.books.incarnations import Incarnations
from engine.cluster.books.requests import RequestBooks
from engine.cluster.peers import PeerLinks
from engine.cluster.requests import apply_ended, apply_tokens
from messages.cluster import (
    CancelForward,
    ClientOp,
    ClientOpResult,
    CommandOutcome,
    EndedForward,
    ForgetRequest,
    Holding,
    PeerFrame,
    Report,
    Returned,
    RunCommand,
    Submit,
    TokensForward,
)
from replicas.directory import ReplicaDirectory

_log = structlog.get_logger("engine.cluster")
HELD_FRAMES: Final = 10_000  # frames held per sender until its new lease is known
HELD_SECONDS: Final = 10.0


class FrameOwner(Protocol):
    """What `Frames` uses of its member (`engine.cluster.member.ClusterMember`) besides the books: the
    node's replicas and peer links, its lease, and the work it starts in its nursery."""

    @property
    def directory(self) -> ReplicaDirectory: ...

    @property
    def peers(self) -> PeerLinks: ...

    @property
    def lease_lost(self) -> bool:
        """This node's lease ended and no new one is taken yet."""
        ...

    @property
    def lease(self) -> int:
        """This node's lease now."""
        ...

    def take_report(self, node: str, report: Report) -> None: ...
    def serve_command(self, frame: PeerFrame, message: RunCommand) -> None: ...
    def serve_op(self, sender: str, message: ClientOp) -> None: ...


@final
class Frames:
    """See the module docstring."""

    def __init__(self, member: FrameOwner, books: RequestBooks, incarnations: Incarnations) -> None:
        self.member = member
        self._books = books
        self._incarnations = incarnations
        self._held: dict[str, list[tuple[float, PeerFrame]]] = {}

    def on_frame(self, frame: PeerFrame) -> None:
        member = self.member
        message = frame.message
        if isinstance(message, CommandOutcome | ClientOpResult):
            member.peers.answer(message)  # an answer to this node's own `ask` (matched by correlation)
            return
        if frame.to_lease and (frame.to_lease != member.lease or member.lease_lost):
            self._to_old_incarnation(frame)
            return
        if not self._incarnations.counts(frame.sender, frame.lease) and not self._stale(frame):
            return
        self._dispatch(frame)

    def _to_old_incarnation(self, frame: PeerFrame) -> None:
        message = frame.message
        _log.info(
            "cluster.frame_to_old_incarnation",
            sender=frame.sender,
            message=type(message).__name__,
            to_lease=f"{frame.to_lease:x}",
            lease=f"{self.member.lease:x}",
        )
        if isinstance(message, Submit):
            reply = Returned(request_id=message.request.request_id, replica=message.replica)
            self.member.peers.send(frame.sender, reply)

    def release(self, node: str) -> None:
        """`node` is known under a new lease: handle its frames held under that lease, drop the rest."""
        lease = self._incarnations.lease_of(node)
        for _, frame in self._held.pop(node, []):
            if frame.lease == lease:
                self.on_frame(frame)

    def expire(self) -> None:
        """Drop the frames held longer than `HELD_SECONDS`."""
        oldest = trio.current_time() - HELD_SECONDS
        for node in list(self._held):
            self._held[node] = [(t, f) for t, f in self._held[node] if t >= oldest]
            if not self._held[node]:
                del self._held[node]

    def _stale(self, frame: PeerFrame) -> bool:
        """A frame under another lease than its sender's known one: True when it is handled all the same."""
        message = frame.message
        known = frame.sender in self._incarnations
        if isinstance(message, RunCommand) and known:
            return True
        if isinstance(message, Submit) and known:
            reply = Returned(request_id=message.request.request_id, replica=message.replica)
            self.member.peers.send(frame.sender, reply)
        else:
            held = self._held.setdefault(frame.sender, [])
            if len(held) < HELD_FRAMES:
                held.append((trio.current_time(), frame))
        return False

    def _dispatch(self, frame: PeerFrame) -> None:
        member, books = self.member, self._books
        message = frame.message
        match message:
            case Report():
                member.take_report(frame.sender, message)
            case Submit():
                request = books.adopt(message.request)
                replica = member.directory.get(message.replica)
                if request is not None and (replica is None or not replica.submit(request)):
                    member.peers.send(
                        frame.sender, Returned(request_id=request.request_id, replica=message.replica)
                    )
                    if request.holder is None:
                        books.drop_mirror(request.request_id)
            case Returned():
                books.returned(message.request_id)
            case RunCommand():
                member.serve_command(frame, message)
            case CommandOutcome() | ClientOpResult():
                member.peers.answer(message)
            case Holding():
                books.holding(message.request_id, frame.sender, message.replica)
            case TokensForward():
                request = books.own(message.request_id)
                if request is not None:
                    apply_tokens(request, message.start, message.token_ids, logprobs=message.logprobs)
            case EndedForward():
                self._ended_elsewhere(message)
            case CancelForward():
                books.cancel_mirror(message.request_id, message.stop_at)
            case ForgetRequest():
                books.forget(message.request_id)
            case ClientOp():
                member.serve_op(frame.sender, message)
            case _:
                assert_never(message)

    def _ended_elsewhere(self, message: EndedForward) -> None:
        request = self._books.own(message.request_id)
        if request is None:
            return
        # A failure anywhere ends it; a normal end counts unless a replica of this node holds it now
        # (then the mirror that ended was an earlier stage's, ended by a cancel or a forget).
        if message.outcome == "failed" or request.holder not in self.member.directory:
            apply_ended(request, message)
