"""The stored responses `previous_response_id` continues: bounded in count (the oldest go first) and
in time (each kept for the TTL after it was stored), on a clock the test sets."""

from __future__ import annotations

from engine.http.responses_api.store import MAX_RESPONSES, TTL_SECONDS, ResponseStore
from messages.openai import ChatMessage


def conversation(text: str) -> list[ChatMessage]:
    return [ChatMessage(role="user", content=text), ChatMessage(role="assistant", content="ok")]


def test_the_store_forgets_the_oldest_beyond_its_count() -> None:
    store = ResponseStore(max_responses=3)
    for index in range(5):
        store.keep(f"resp_{index}", conversation(str(index)))
    assert len(store) == 3
    assert store.conversation("resp_0") is None and store.conversation("resp_1") is None
    assert store.conversation("resp_4") == conversation("4")


def test_the_store_forgets_a_response_after_its_ttl() -> None:
    now = [0.0]
    store = ResponseStore(ttl=10.0, clock=lambda: now[0])
    store.keep("resp_a", conversation("a"))
    now[0] = 5.0
    store.keep("resp_b", conversation("b"))
    now[0] = 10.0
    assert store.conversation("resp_a") is None
    assert store.conversation("resp_b") == conversation("b")
    now[0] = 15.0
    assert store.conversation("resp_b") is None and len(store) == 0


def test_a_kept_conversation_is_a_copy() -> None:
    store = ResponseStore()
    kept = conversation("x")
    store.keep("resp_x", kept)
    kept.append(ChatMessage(role="user", content="later"))
    got = store.conversation("resp_x")
    assert got == conversation("x")
    assert got is not None
    got.append(ChatMessage(role="user", content="mine"))
    assert store.conversation("resp_x") == conversation("x")
    assert (MAX_RESPONSES, TTL_SECONDS) == (1024, 3600.0)  # the bounds docs/http-api.md states
