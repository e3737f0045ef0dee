"""OpenAI's Responses API through a real node and the `openai` client (`client.responses.create`): a
string or items as input, instructions, streamed events that add up to the whole response, stored
responses continued by `previous_response_id` and read back by id, and function tools parsed as on
chat. The node has Qwen2.5's chat template and `--tool-call-parser hermes`; a response runs as the chat
completion of the same conversation, so each is checked against that chat completion (greedy, token
for token)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.http.conftest import tool_node
from tests.model.text.test_chat_template import WEATHER_TOOL
from tests.node.harness import NodeProcess

FLAT_TOOL = {"type": "function", **WEATHER_TOOL["function"]}  # the Responses API's spelling


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    with tool_node(tmp_path_factory.mktemp("responses")) as served:
        yield served


async def chat_text(client: openai.AsyncOpenAI, messages: list[Any], max_tokens: int, **extra: Any) -> Any:
    reply = await client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=max_tokens, temperature=0, **extra
    )
    return reply


async def test_a_response_is_the_chat_completion_of_its_input(client: openai.AsyncOpenAI) -> None:
    response = await client.responses.create(
        model="tiny", input="Hello there", instructions="Be brief.", max_output_tokens=12, temperature=0
    )
    chat = await chat_text(
        client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}], 12
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == chat.choices[0].message.content
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    if response.status == "incomplete":
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and chat.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"

    items = await client.responses.create(
        model="tiny",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Hello "},
                    {"type": "input_text", "text": "there"},
                ],
            }
        ],
        instructions="Be brief.",
        max_output_tokens=12,
        temperature=0,
    )
    assert items.output_text == response.output_text


async def test_a_streamed_response_adds_up_to_the_whole_one(client: openai.AsyncOpenAI) -> None:
    whole = await client.responses.create(
        model="tiny", input="Stream me", max_output_tokens=10, temperature=0
    )
    stream = await client.responses.create(
        model="tiny", input="Stream me", max_output_tokens=10, temperature=0, stream=True
    )
    events = [event async for event in stream]
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if whole.status == "completed" else "response.incomplete",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text
    done = next(event for event in events if event.type == "response.output_text.done")
    assert done.text == text
    last = events[-1].response  # type: ignore[union-attr]
    assert last.output_text == whole.output_text and last.status == whole.status


async def test_previous_response_id_continues_the_conversation(client: openai.AsyncOpenAI) -> None:
    first = await client.responses.create(
        model="tiny", input="My name is Ada.", instructions="Be kind.", max_output_tokens=6, temperature=0
    )
    second = await client.responses.create(
        model="tiny",
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=6,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    chat = await chat_text(
        client,
        [  # the instructions are not carried over, as on OpenAI
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"},
        ],
        6,
    )
    assert second.output_text == chat.choices[0].message.content
    assert second.usage is not None and chat.usage is not None
    assert second.usage.input_tokens == chat.usage.prompt_tokens

    retrieved = await client.responses.retrieve(first.id)
    assert (retrieved.id, retrieved.output_text, retrieved.status) == (
        first.id,
        first.output_text,
        first.status,
    )

    unstored = await client.responses.create(
        model="tiny", input="forget me", store=False, max_output_tokens=2
    )
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        await client.responses.create(
            model="tiny", input="again", previous_response_id=unstored.id, max_output_tokens=2
        )


async def test_function_tools_and_call_items_run_as_on_chat(client: openai.AsyncOpenAI) -> None:
    conversation: list[Any] = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": '{"temperature": 21}'},
    ]
    response = await client.responses.create(
        model="tiny",
        input=conversation,
        tools=[FLAT_TOOL],
        max_output_tokens=24,
        temperature=0,
    )
    chat = await chat_text(
        client,
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
        ],
        24,
        tools=[WEATHER_TOOL],
    )
    message = chat.choices[0].message
    assert response.output_text == (message.content or "")
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(call.name, call.arguments) for call in calls] == [
        (call.function.name, call.function.arguments) for call in message.tool_calls or []
    ]
    assert all(call.call_id.startswith("call_") for call in calls)
    assert [tool.name for tool in response.tools] == ["get_weather"]  # type: ignore[union-attr]
    assert response.tool_choice == "auto"


async def test_a_required_tool_choice_answers_with_function_call_items(client: openai.AsyncOpenAI) -> None:
    """`tool_choice: "required"` holds the reply to calls (`engine.http.tools.choice`), as on chat."""
    short = {
        **FLAT_TOOL,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
    response = await client.responses.create(
        model="tiny",
        input="Weather in Paris?",
        tools=[short],  # type: ignore[list-item]
        tool_choice="required",
        max_output_tokens=80,
        temperature=0,
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(call.name == "get_weather" for call in calls), response.output
    assert all(set(json.loads(call.arguments)) == {"city"} for call in calls)
    assert response.output_text == ""
