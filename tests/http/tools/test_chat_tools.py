"""Function tools on `/v1/chat/completions` through a real node and the `openai` client: a node with
Qwen2.5's chat template and `--tool-call-parser hermes`. The tools, an assistant message's calls and a
tool message reach the template (the prompt is what the template renders from them, token for token),
and the reply is the model's text through the parser — streamed and not alike. The tiny model rarely
writes a call; which calls parse from fixed text is tests/http/tools/test_tool_parsers.py's to show."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import openai
import pytest

from engine.http.tools.choice import tools_schema
from engine.http.tools.parsers import parse
from messages.openai import ToolDefinition
from replicas.model import ChatTemplate
from tests.http.conftest import tool_node
from tests.model.text.test_chat_template import QWEN2_TEMPLATE, WEATHER_TOOL
from tests.node.harness import NodeProcess

MESSAGES: list[Any] = [
    {"role": "system", "content": "You help with the weather."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    with tool_node(tmp_path_factory.mktemp("tools")) as served:
        yield served


def rendered() -> str:
    """The prompt as the template renders it: the calls' arguments as objects, as transformers has them."""
    messages = json.loads(json.dumps(MESSAGES))
    messages[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    return ChatTemplate(QWEN2_TEMPLATE).render(messages, add_generation_prompt=True, tools=[WEATHER_TOOL])


async def test_tools_and_tool_messages_are_rendered_and_the_reply_parsed(client: openai.AsyncOpenAI) -> None:
    text = rendered()
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in text
    assert '"name": "get_weather"' in text.split("<tools>\n")[1]
    chat = await client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[WEATHER_TOOL], max_tokens=24, temperature=0
    )
    raw = await client.completions.create(
        model="tiny", prompt=list(text.encode()), max_tokens=24, temperature=0
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == len(text.encode())
    expected = parse("hermes", raw.choices[0].text)
    message = chat.choices[0].message
    assert message.content == expected.content
    calls = message.tool_calls or []
    assert [(call.function.name, call.function.arguments) for call in calls] == [
        (call.name, call.arguments) for call in expected.calls
    ]
    assert all(call.id.startswith("call_") and call.type == "function" for call in calls)
    assert chat.choices[0].finish_reason == ("tool_calls" if calls else raw.choices[0].finish_reason)


async def test_a_streamed_reply_with_tools_adds_up_to_the_whole_one(client: openai.AsyncOpenAI) -> None:
    whole = await client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=[WEATHER_TOOL],
        tool_choice="auto",
        max_tokens=24,
        temperature=0,
    )
    stream = await client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=[WEATHER_TOOL],
        tool_choice="auto",
        max_tokens=24,
        temperature=0,
        stream=True,
    )
    chunks = [chunk async for chunk in stream]
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert deltas[0].role == "assistant"
    content = "".join(delta.content or "" for delta in deltas)
    calls = [call for delta in deltas for call in delta.tool_calls or []]
    message = whole.choices[0].message
    assert content == (message.content or "")
    assert [(call.function.name, call.function.arguments) for call in calls if call.function] == [
        (call.function.name, call.function.arguments) for call in message.tool_calls or []
    ]
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


async def test_tool_choice_none_keeps_the_text_as_it_is(client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=8, temperature=0
    )
    raw = await client.completions.create(
        model="tiny", prompt=list(rendered().encode()), max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.content == raw.choices[0].text
    assert not reply.choices[0].message.tool_calls


# Arguments short enough that a forced reply always ends within its max_tokens (a free string could run on).
CITY_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_choice_required_always_answers_with_calls(
    client: openai.AsyncOpenAI, stream: bool
) -> None:
    """`required`: the reply is held to a JSON list of calls to the tools — whatever the model would have
    written — and comes back as `tool_calls`, the same tokens as a completion of the rendered prompt held
    to that list's schema (the structured-output machinery)."""
    asked: dict[str, Any] = {
        "model": "tiny",
        "messages": ASK,
        "tools": [CITY_TOOL, TIME_TOOL],
        "tool_choice": "required",
        "max_tokens": 120,
        "temperature": 0,
    }
    if stream:
        chunks = [chunk async for chunk in await client.chat.completions.create(**asked, stream=True)]
        deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
        calls = [call.function for delta in deltas for call in delta.tool_calls or [] if call.function]
        assert "".join(delta.content or "" for delta in deltas) == ""
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    else:
        reply = await client.chat.completions.create(**asked)
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
        calls = [call.function for call in message.tool_calls or []]
    assert calls
    for call in calls:
        assert call.name in ("get_weather", "get_time")
        arguments = json.loads(call.arguments)
        assert set(arguments) == ({"city"} if call.name == "get_weather" else {"zone"}), arguments

    prompt = ChatTemplate(QWEN2_TEMPLATE).render(
        ASK, add_generation_prompt=True, tools=[CITY_TOOL, TIME_TOOL]
    )
    schema = tools_schema([msgspec.convert(tool, ToolDefinition) for tool in (CITY_TOOL, TIME_TOOL)])
    raw = await client.completions.create(
        model="tiny",
        prompt=list(prompt.encode()),
        max_tokens=120,
        temperature=0,
        extra_body={"structured_outputs": {"json": schema}},
    )
    held = parse("forced", raw.choices[0].text).calls
    assert [(c.name, c.arguments) for c in held] == [(c.name, c.arguments) for c in calls]


async def test_a_named_tool_choice_calls_that_function(client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[CITY_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=120,
        temperature=0,
    )
    calls = reply.choices[0].message.tool_calls or []
    assert reply.choices[0].finish_reason == "tool_calls" and calls
    assert {call.function.name for call in calls} == {"get_time"}
    assert all(json.loads(call.function.arguments)["zone"] in ("UTC", "CET") for call in calls)


async def test_tokenize_renders_tools_as_chat_does(http: httpx.AsyncClient) -> None:
    counted = await http.post(
        "/tokenize", json={"messages": MESSAGES, "tools": [WEATHER_TOOL], "add_special_tokens": False}
    )
    assert counted.status_code == 200, counted.text
    assert counted.json()["tokens"] == list(rendered().encode())
