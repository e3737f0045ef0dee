"""The cluster's request books (`engine.cluster.books`) as one node keeps them: a real router and replica
directory, with the peer messages the books send recorded where the peer links would send them."""

from __future__ import annotations

from engine.cluster.books.incarnations import Incarnations
from engine.cluster.books.requests import RequestBooks
from engine.cluster.requests import snapshot
from engine.router import Router
from messages.cluster import EndedForward, ForgetRequest, Holding, PeerMessage, Returned
from messages.log.events import LogEvent
from replicas.directory import ReplicaDirectory
from replicas.model import SamplingParams
from replicas.request import FailedUpdate, FinishedUpdate, RequestSpec, ServingRequest
from replicas.settings import ReplicaSettings

OTHERS = ["b", "c"]


class Sent:
    """Where the books' peer messages go: kept in order, per node."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, PeerMessage]] = []

    def send(self, node_id: str, message: PeerMessage) -> bool:
        self.messages.append((node_id, message))
        return True

    def broadcast(self, nodes: list[str], message: PeerMessage) -> None:
        for node in nodes:
            self.send(node, message)


class Events:
    def __init__(self) -> None:
        self.events: list[LogEvent] = []

    def emit(self, event: LogEvent) -> None:
        self.events.append(event)

    def bind(self, *, request_id: str | None = None, replica: str | None = None) -> Events:
        return self


def node(name: str = "a") -> tuple[RequestBooks, Router, Sent]:
    directory = ReplicaDirectory()
    router = Router(directory, Events(), settings=ReplicaSettings(), max_queue=16)
    sent = Sent()
    books = RequestBooks(name, router=router, post=sent, replicas=directory, others=lambda: OTHERS)
    return books, router, sent


def request(request_id: str) -> ServingRequest:
    spec = RequestSpec.of(
        request_id=request_id, prompt_ids=[1, 2, 3], images=[], sampling=SamplingParams(), max_tokens=4
    )
    return ServingRequest(spec, eos_token_ids=[])


async def test_a_request_held_by_a_node_that_leaves_fails_and_the_others_forget_it() -> None:
    books, router, sent = node()
    stays, moves = request("stays"), request("moves")
    router.admit(stays)
    router.admit(moves)
    books.held_at(stays, "b")
    books.held_at(moves, "b")
    books.holding("moves", "c", "c/decode-0")  # its KV moved on: node c's decode replica holds it
    assert moves.holder == "c/decode-0"
    books.end_shared("b", "node b left")
    assert isinstance(stays.final_update, FailedUpdate) and stays.final_update.code == "replica_failed"
    assert not moves.ended  # node b holds it no more
    books.end_shared("c", "node c left")
    assert isinstance(moves.final_update, FailedUpdate) and moves.final_update.code == "replica_failed"
    for request_id in ("stays", "moves"):
        assert {n for n, m in sent.messages if m == ForgetRequest(request_id=request_id)} == set(OTHERS)


async def test_a_returned_request_goes_back_to_the_front_of_the_queue() -> None:
    books, router, _ = node()
    first, second = request("first"), request("second")
    router.admit(first)
    router.admit(second)
    router.pending.remove(second)  # given to node b
    books.held_at(second, "b")
    second.hand_to("b/prefill-0")
    books.returned("second")
    assert second.holder is None and list(router.pending) == [second, first]
    books.end_shared("b", "node b left")
    assert not second.ended  # b gave it back: it holds it no more


async def test_a_mirror_ends_when_its_origin_forgets_it_and_is_not_adopted_again() -> None:
    _, origin_router, _ = node("b")
    asked = request("r1")
    origin_router.admit(asked)
    books, router, sent = node("a")
    mirror = books.adopt(snapshot(asked, "b", images=False))
    assert mirror is not None and books.mirror_of("r1") is mirror and books.own("r1") is None
    assert books.origin_of(mirror) == "b" and router.requests["r1"] is mirror
    books.holding("r1", "c", "c/decode-0")  # a mirror's holder is not the origin's to say
    assert mirror.holder is None
    books.now_holding("r1", "a/decode-0")
    assert ("b", Holding(request_id="r1", replica="a/decode-0")) in sent.messages
    books.forget("r1")
    assert (
        isinstance(mirror.final_update, FinishedUpdate) and mirror.final_update.finish_reason == "cancelled"
    )
    assert [m for node, m in sent.messages if node == "b" and isinstance(m, EndedForward)]
    assert books.mirror_of("r1") is None and "r1" not in router.requests
    assert books.adopt(snapshot(asked, "b", images=False)) is None  # forgotten: refused


async def test_a_mirror_given_back_returns_to_its_origin_and_leaves_the_books() -> None:
    books, router, sent = node("a")
    mirror = books.adopt(snapshot(request("r2"), "b", images=False))
    assert mirror is not None
    mirror.hand_to("a/prefill-0")
    books.give_back(mirror)
    assert ("b", Returned(request_id="r2", replica="a/prefill-0")) in sent.messages
    assert books.mirror_of("r2") is None and "r2" not in router.requests and not mirror.ended
    books.end_shared("b", "node b left")
    assert not mirror.ended  # not a mirror here any more: nothing of it ends with its origin


def test_a_node_is_known_under_one_lease_at_a_time() -> None:
    known = Incarnations()
    assert "b" not in known and known.lease_of("b") is None and not known.counts("b", 7)
    assert known.know("b", 7) and not known.know("b", 7)
    assert known.counts("b", 7) and not known.counts("b", 8) and known.nodes() == ["b"]
    assert known.forget("b") == 7 and known.forget("b") == 0 and "b" not in known
