"""A response's events and whole body built from fixed model text with calls in it (the tiny model
rarely writes one): the stream's events, in OpenAI's order and numbered from 0, add up to the whole
response, and the stored conversation holds the calls for the next turn."""

from __future__ import annotations

import json

import msgspec

from engine.generate.generation import Outcome, Piece
from engine.http.responses_api.output import ResponseBuilder, ResponseEvents, whole
from engine.http.responses_api.store import ResponseStore
from engine.http.responses_api.turn import turn
from messages.control_replies import Timings
from messages.responses_api.requests import ResponsesRequest
from tests.http.tools.test_tool_parsers import HERMES

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def outcome(text: str) -> Outcome:
    return Outcome(
        request_id="r",
        prompt_tokens=5,
        token_ids=list(range(len(text))),
        text=text,
        finish_reason="stop",
        timings=Timings(),
        transfers=[],
    )


def builder(store: ResponseStore, response_id: str) -> ResponseBuilder:
    body = msgspec.convert({"input": "Weather?", "tools": [TOOL], "stream": True}, type=ResponsesRequest)
    return ResponseBuilder(turn(body, store, "hermes"), response_id, "tiny", 0, store)


def events(raw: bytes) -> list[dict]:
    parsed = []
    for block in raw.decode().split("\n\n"):
        if block:
            kind, data = block.split("\n")
            parsed.append(json.loads(data.removeprefix("data: ")))
            assert kind == f"event: {parsed[-1]['type']}"
    return parsed


def test_streamed_events_add_up_to_the_whole_response() -> None:
    store = ResponseStore()
    expected = msgspec.to_builtins(whole(builder(store, "resp_whole"), outcome(HERMES)))
    stream = ResponseEvents(builder(store, "resp_stream"))
    raw = stream.start()
    for start in range(0, len(HERMES), 4):
        raw += stream.piece(Piece(index=start, token_ids=(), text=HERMES[start : start + 4]))
    raw += stream.finish(outcome(HERMES))
    sent = events(raw)
    assert [event["sequence_number"] for event in sent] == list(range(len(sent)))
    kinds = [event["type"] for event in sent]
    kinds = [kind for at, kind in enumerate(kinds) if at == 0 or kind != kinds[at - 1] or "delta" not in kind]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",  # the message, at its first text
        "response.content_part.added",
        "response.output_text.delta",  # (one or more)
        "response.output_item.added",  # each call, whole
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    last = sent[-1]["response"]
    assert last["status"] == expected["status"] == "completed"
    strip = lambda items: [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]  # noqa: E731
    assert strip(last["output"]) == strip(expected["output"])
    assert [item["type"] for item in last["output"]] == ["message", "function_call", "function_call"]
    assert last["output"][0]["content"][0]["text"] == "Let me check."
    assert [(item["name"], json.loads(item["arguments"])) for item in last["output"][1:]] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "CET", "precise": True}),
    ]
    text = "".join(event["delta"] for event in sent if event["type"] == "response.output_text.delta")
    assert text == "Let me check."

    [_user, answer] = store.conversation("resp_stream") or []
    assert answer.role == "assistant" and answer.content == "Let me check."
    assert [call.function.name for call in answer.tool_calls or []] == ["get_weather", "get_time"]
    assert [call.id for call in answer.tool_calls or []] == [item["call_id"] for item in last["output"][1:]]
