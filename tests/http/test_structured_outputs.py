"""Structured outputs through a real node and the `openai` client: OpenAI's `response_format`
(`json_object`, `json_schema`) and vLLM's `structured_outputs` (`regex`, `choice`, `grammar`) and
`guided_*` fields, streamed and not, on both endpoints; the answers parse and match what was asked, and
a grammar that does not compile is a 400 saying why, with nothing queued.

The node serves the built-in `tiny` model (random weights, a byte tokenizer): its greedy text wanders,
so each constraint here is one whose every answer ends within `max_tokens` — except `json_object`,
whose seed was picked for an object that closes within 48 tokens.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import openai
import pytest

from messages.grammar import JsonGrammar
from replicas.model import ByteTokenizer, SamplingParams, generate_in_one_piece, tiny_model

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"enum": ["red", "green", "blue"]},
    },
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
}


def check_answer(text: str) -> None:
    """`text` is a JSON object that `SCHEMA` validates (checked by hand: no jsonschema here)."""
    value = json.loads(text)
    assert isinstance(value, dict) and set(value) == {"ok", "n", "tag"}, text
    assert isinstance(value["ok"], bool)
    assert isinstance(value["n"], int) and not isinstance(value["n"], bool) and 0 <= value["n"] <= 99
    assert value["tag"] in ("red", "green", "blue")


async def completion_text(client: openai.AsyncOpenAI, stream: bool, **body: Any) -> tuple[str, str | None]:
    """A completion's text and finish reason, streamed or not."""
    if not stream:
        reply = await client.completions.create(model="tiny", **body)
        return reply.choices[0].text, reply.choices[0].finish_reason
    chunks = [chunk async for chunk in await client.completions.create(model="tiny", stream=True, **body)]
    text = "".join(choice.text for chunk in chunks for choice in chunk.choices)
    return text, chunks[-1].choices[0].finish_reason


async def chat_text(client: openai.AsyncOpenAI, stream: bool, **body: Any) -> tuple[str, str | None]:
    messages: Any = [{"role": "user", "content": "Answer in JSON."}]
    if not stream:
        reply = await client.chat.completions.create(model="tiny", messages=messages, **body)
        return reply.choices[0].message.content or "", reply.choices[0].finish_reason
    stream_ = await client.chat.completions.create(model="tiny", messages=messages, stream=True, **body)
    chunks = [chunk async for chunk in stream_]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    return text, chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
async def test_a_json_schema_answer_validates(client: openai.AsyncOpenAI, stream: bool) -> None:
    for temperature, seed in ((0.0, None), (1.0, 7)):
        text, reason = await chat_text(
            client,
            stream,
            max_tokens=60,
            temperature=temperature,
            seed=seed,
            response_format=JSON_SCHEMA_FORMAT,
        )
        check_answer(text)
        assert reason == "stop"
        text, reason = await completion_text(
            client,
            stream,
            prompt="zigzag",
            max_tokens=60,
            temperature=temperature,
            seed=seed,
            extra_body={"response_format": JSON_SCHEMA_FORMAT},
        )
        check_answer(text)
        assert reason == "stop"


async def test_a_streamed_answer_equals_the_whole_one(client: openai.AsyncOpenAI) -> None:
    whole = await chat_text(client, False, max_tokens=60, temperature=0, response_format=JSON_SCHEMA_FORMAT)
    assert (
        await chat_text(client, True, max_tokens=60, temperature=0, response_format=JSON_SCHEMA_FORMAT)
        == whole
    )


async def test_a_json_object_answer_is_an_object(client: openai.AsyncOpenAI) -> None:
    for stream in (False, True):
        text, reason = await completion_text(
            client,
            stream,
            prompt="hi",
            max_tokens=48,
            temperature=1.0,
            seed=46,
            extra_body={"response_format": {"type": "json_object"}},
        )
        assert reason == "stop"
        assert isinstance(json.loads(text), dict), text


async def test_regex_choice_and_grammar(client: openai.AsyncOpenAI) -> None:
    pattern = r"[a-z]{3}-[0-9]{2}"
    for stream in (False, True):
        for spelling in ({"structured_outputs": {"regex": pattern}}, {"guided_regex": pattern}):
            text, reason = await completion_text(
                client, stream, prompt="code:", max_tokens=20, temperature=0, extra_body=spelling
            )
            assert re.fullmatch(pattern, text) and reason == "stop", text
        choices = ["red", "green", "blue"]
        for seed in range(4):
            text, reason = await completion_text(
                client,
                stream,
                prompt="colour:",
                max_tokens=20,
                temperature=1.0,
                seed=seed,
                extra_body={"structured_outputs": {"choice": choices}},
            )
            assert text in choices and reason == "stop", text
        text, reason = await completion_text(
            client,
            stream,
            prompt="sum:",
            max_tokens=30,
            temperature=0,
            extra_body={"structured_outputs": {"grammar": 'start: num " + " num\nnum: /[1-9][0-9]?/'}},
        )
        assert re.fullmatch(r"[1-9][0-9]? \+ [1-9][0-9]?", text) and reason == "stop", text


async def test_the_answer_equals_the_model_run_in_one_piece(client: openai.AsyncOpenAI) -> None:
    """Prefill on one replica, decode on another, each rebuilding the grammar's matcher: token for token
    the tiny model run in one piece under the same grammar, greedy and sampled."""
    model = tiny_model()
    tokenizer = ByteTokenizer(model.config.vocab_size)
    prompt = list(b"zigzag")
    grammar = JsonGrammar(schema=json.dumps(SCHEMA))
    for temperature, seed in ((0.0, 0), (1.0, 5)):
        sampling = SamplingParams(temperature=temperature, seed=seed, grammar=grammar)
        expected = generate_in_one_piece(model, prompt, max_tokens=60, sampling=sampling)
        reply = await client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=60,
            temperature=temperature,
            seed=seed,
            extra_body={"response_format": JSON_SCHEMA_FORMAT},
        )
        assert reply.choices[0].text == tokenizer.decode(expected)
        check_answer(reply.choices[0].text)


async def test_a_grammar_that_does_not_compile_is_a_400_saying_why(http: httpx.AsyncClient) -> None:
    cases: list[tuple[dict[str, Any], str, str]] = [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format.json_schema.schema",
            "nope",
        ),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "unclosed group"),
        ({"structured_outputs": {"grammar": "start: missing"}}, "structured_outputs.grammar", "missing"),
        ({"guided_json": "{not json"}, "guided_json", "not JSON"),
        (
            {"structured_outputs": {"structural_tag": {"type": "structural_tag"}}},
            "structured_outputs.structural_tag",
            "not supported",
        ),
    ]
    for extra, param, reason in cases:
        reply = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, **extra})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param and reason in error["message"], error
    assert (await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})).status_code == 200
