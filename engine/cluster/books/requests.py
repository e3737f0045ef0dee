"""The books of the requests that cross nodes: which node holds each request this node admitted, the
mirrors this node holds of other nodes' requests and their origins (docs/cluster.md).

Who holds what: the origin of a request keeps it; a node that works on it holds a mirror
(`engine.cluster.requests`). The origin knows which node holds its request now (the node it submitted
it to, then the node whose replica took its KV or its relayed prefill, which says so with `Holding`);
when that node leaves the cluster the request fails with `replica_failed` (`end_shared`). Mirrors of
requests whose origin left are cancelled (their client is gone), so their blocks return to the pools. A
cancel reaches every node (`CancelForward`); when the origin's request ends it tells every node to
forget it (`ForgetRequest`), and a mirror that arrives after that is refused (the ids stay remembered
for a while).

`RequestBooks` is the one writer of these books; the member's parts ask it by what happened (`held_at`,
`holding`, `returned`, `adopt`, `forget`, ...). It also hands a request to its holder where the books
learn who holds it (`ServingRequest.hand_to`). Runs on the Trio thread; nothing here waits.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Final, Protocol, final

from engine.cluster.requests import ended_forward, merge_snapshot, mirror
from engine.generate.logprobs import records
from messages.cluster import (
    CancelForward,
    ForgetRequest,
    Holding,
    PeerMessage,
    RequestSnapshot,
    Returned,
    TokensForward,
)
from replicas.request import ServingRequest

REMEMBERED_IDS: Final = 10_000  # forgotten request ids kept, to refuse a mirror that comes after


class RequestsRouter(Protocol):
    """What the books use of the node's router: its requests, holding a mirror, queueing one again."""

    @property
    def requests(self) -> Mapping[str, ServingRequest]:
        """The node's live requests by id: its own and the mirrors it holds."""
        ...

    def hold(self, request: ServingRequest) -> None: ...
    def release(self, request: ServingRequest) -> None: ...
    def take_back(self, request: ServingRequest) -> None: ...
    def dispatch(self) -> None: ...


class Post(Protocol):
    """The peer links, as the books use them: a message to one node, or to several."""

    def send(self, node_id: str, message: PeerMessage) -> bool: ...
    def broadcast(self, nodes: list[str], message: PeerMessage) -> None: ...


class Postable(Protocol):
    def post(self) -> None:
        """Look at the queues again (a cancelled request frees its blocks at the next look)."""
        ...


class LocalReplicas(Protocol):
    """This node's replicas, as the books use them: which names are local, and waking them."""

    def __contains__(self, name: object) -> bool: ...
    def local(self) -> Sequence[Postable]: ...


@final
class RequestBooks:
    """See the module docstring. `node_id` is this node; `others` names the other members now."""

    def __init__(
        self,
        node_id: str,
        *,
        router: RequestsRouter,
        post: Post,
        replicas: LocalReplicas,
        others: Callable[[], list[str]],
    ) -> None:
        self._node_id = node_id
        self._router = router
        self._post = post
        self._replicas = replicas
        self._others = others
        self._holders: dict[str, str] = {}  # origin side: request id -> the node holding it
        self._mirrors: dict[str, ServingRequest] = {}  # mirror request id -> the mirror
        self._origins: dict[str, str] = {}  # mirror request id -> its origin node
        self._tracked: set[str] = set()  # origin side: requests other nodes know of
        self._forgotten: set[str] = set()
        self._forgotten_order: deque[str] = deque()
        self._token_hooks: dict[str, Callable[[int, Sequence[int]], None]] = {}  # mirror -> its relay

    # ------------------------------------------------------------------ reading
    def live(self, request_id: str) -> ServingRequest | None:
        """The node's request `request_id` (its own, or a mirror it holds); None: not live here."""
        return self._router.requests.get(request_id)

    def mirror_of(self, request_id: str) -> ServingRequest | None:
        """The mirror of another node's request `request_id` held here; None: none."""
        return self._mirrors.get(request_id)

    def own(self, request_id: str) -> ServingRequest | None:
        """The live request `request_id` this node admitted (not a mirror); None: none."""
        if request_id in self._mirrors:
            return None
        return self._router.requests.get(request_id)

    def origin_of(self, request: ServingRequest) -> str:
        """The node that admitted `request`: its origin for a mirror, else this node."""
        return self._origins.get(request.request_id, self._node_id)

    # ------------------------------------------------------------------ origin side
    def track(self, request: ServingRequest) -> None:
        """The first time another node hears of a request this node admitted: its cancel is forwarded to
        every node, and every node forgets it when it ends. A mirror or one tracked already: nothing."""
        if request.request_id in self._tracked or request.request_id in self._mirrors:
            return
        self._tracked.add(request.request_id)
        request.on_cancel.append(self._cancelled)
        request.on_end.append(self._origin_ended)

    def held_at(self, request: ServingRequest, node: str) -> None:
        """`node` holds `request` now (it was submitted there, a replica there reserved its KV, or took
        its relayed prefill): tracked, and failed if `node` leaves. A mirror: nothing (its origin hears
        from the holding node itself, `now_holding`); an ended request: nothing (no one holds it)."""
        if request.request_id in self._mirrors or request.ended:
            return
        self.track(request)
        self._holders[request.request_id] = node

    def holding(self, request_id: str, node: str, replica: str) -> None:
        """`Holding` from `node`: its replica `replica` holds this node's request `request_id` now."""
        request = self.own(request_id)
        if request is not None:
            self._holders[request_id] = node
            request.hand_to(replica)

    def returned(self, request_id: str) -> None:
        """`Returned`: the node this node's request was submitted to gave it back; it goes to the front
        of the router's queue and is dispatched again."""
        self._holders.pop(request_id, None)
        request = self._router.requests.get(request_id)
        if request is not None and not request.ended:
            request.hand_to(None)
            self._router.take_back(request)
            self._router.dispatch()

    def now_holding(self, request_id: str, replica: str) -> None:
        """This node's replica `replica` holds request `request_id` now: a mirror's origin hears of it
        (`Holding`); a request of this node's own is no longer held elsewhere."""
        origin = self._origins.get(request_id)
        if origin is not None:
            self._post.send(origin, Holding(request_id=request_id, replica=replica))
        else:
            self._holders.pop(request_id, None)

    def _cancelled(self, request: ServingRequest) -> None:
        message = CancelForward(request_id=request.request_id, stop_at=request.stop_at)
        self._post.broadcast(self._others(), message)

    def _origin_ended(self, request: ServingRequest) -> None:
        self._tracked.discard(request.request_id)
        self._holders.pop(request.request_id, None)
        self._post.broadcast(self._others(), ForgetRequest(request_id=request.request_id))

    # ------------------------------------------------------------------ mirrors
    def adopt(self, snap: RequestSnapshot) -> ServingRequest | None:
        """The request object `snap` describes on this node: the one it already has (brought up to the
        snapshot), or a new mirror, held by the router; None when the request already ended here or was
        forgotten."""
        existing = self._router.requests.get(snap.request_id)
        if existing is not None:
            merge_snapshot(existing, snap)
            return None if existing.ended else existing
        if snap.request_id in self._forgotten or snap.origin == self._node_id:
            # Forgotten here, or this node's own request that ended: a node that still held it (a
            # ZigZag OldPrefill reserving a decode replica here, say) had not heard of its end yet.
            return None
        request = mirror(snap)
        self._mirrors[snap.request_id] = request
        self._origins[snap.request_id] = snap.origin
        self._router.hold(request)

        def forward_tokens(start: int, ids: Sequence[int]) -> None:
            scored = records(request.generated_logprobs[start : start + len(ids)])
            message = TokensForward(
                request_id=snap.request_id, start=start, token_ids=list(ids), logprobs=scored
            )
            self._post.send(snap.origin, message)

        self._token_hooks[snap.request_id] = forward_tokens
        request.on_tokens.append(forward_tokens)
        request.on_end.append(self._mirror_ended)
        return request

    def drop_mirror(self, request_id: str) -> None:
        """Forget the mirror `request_id` without ending it (its work went back to the origin); not a
        mirror: nothing."""
        request = self._mirrors.pop(request_id, None)
        if request is None:
            return
        self._origins.pop(request_id, None)
        self._drop_token_hook(request)
        self._router.release(request)

    def give_back(self, request: ServingRequest) -> None:
        """A replica gave back a mirror (`Router.held_returned`): it goes back to its origin."""
        origin = self._origins.get(request.request_id)
        if origin is None:
            return
        self._post.send(origin, Returned(request_id=request.request_id, replica=request.holder or ""))
        self.drop_mirror(request.request_id)

    def end_mirror(self, request: ServingRequest) -> None:
        """Stop a mirror: its holder frees what it holds; one no replica here holds ends at once."""
        request.cancel()
        if request.holder is None or request.holder not in self._replicas:
            request.finish("cancelled")

    def forget(self, request_id: str) -> None:
        """`ForgetRequest`: the origin's request ended. Its id is remembered (a mirror that comes after
        is refused) and a live mirror of it ends."""
        self._remember(request_id)
        request = self._mirrors.get(request_id)
        if request is not None and not request.ended:
            self.end_mirror(request)

    def cancel_mirror(self, request_id: str, stop_at: int | None) -> None:
        """`CancelForward`: cancel the mirror `request_id` (or stop it early at `stop_at` tokens); with no
        mirror here yet, one made later starts cancelled."""
        request = self._mirrors.get(request_id)
        if request is None:
            self._remember(request_id)
            return
        if stop_at is not None:
            request.stop_early(stop_at)
        else:
            request.cancel()
        self._wake()

    def end_shared(self, node: str, why: str) -> None:
        """End the requests shared with `node`: this node's requests it held fail, the mirrors of its
        requests here stop (detached first: nothing about them is forwarded to a later incarnation)."""
        for request_id, holder in list(self._holders.items()):
            request = self._router.requests.get(request_id)
            if holder == node:
                self._holders.pop(request_id, None)
                if request is not None and not request.ended:
                    request.fail(
                        "replica_failed",
                        f"{why} while it held request {request_id}; the request can be sent again",
                    )
        for request_id, origin in list(self._origins.items()):
            mirrored = self._mirrors.get(request_id)
            if origin == node and mirrored is not None:
                self._remember(request_id)
                self._mirrors.pop(request_id, None)
                self._origins.pop(request_id, None)
                self._drop_token_hook(mirrored)
                self.end_mirror(mirrored)  # its client is gone with its origin
        self._wake()

    def _wake(self) -> None:
        for replica in self._replicas.local():
            replica.post()  # their holders look at their queues again: the cancelled ones free blocks

    def _mirror_ended(self, request: ServingRequest) -> None:
        self._token_hooks.pop(request.request_id, None)
        origin = self._origins.pop(request.request_id, None)
        if self._mirrors.pop(request.request_id, None) is not None and origin is not None:
            self._post.send(origin, ended_forward(request))

    def _drop_token_hook(self, request: ServingRequest) -> None:
        hook = self._token_hooks.pop(request.request_id, None)
        if hook is not None and hook in request.on_tokens:
            request.on_tokens.remove(hook)

    def _remember(self, request_id: str) -> None:
        if request_id not in self._forgotten:
            self._forgotten.add(request_id)
            self._forgotten_order.append(request_id)
            if len(self._forgotten_order) > REMEMBERED_IDS:
                self._forgotten.discard(self._forgotten_order.popleft())
