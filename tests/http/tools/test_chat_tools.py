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
import openai
import pytest

from engine.http.tools.parsers import parse
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
    with pytest.raises(openai.BadRequestError, match="not supported yet"):
        await client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=2
        )


async def test_tokenize_renders_tools_as_chat_does(http: httpx.AsyncClient) -> None:
    counted = await http.post(
        "/tokenize", json={"messages": MESSAGES, "tools": [WEATHER_TOOL], "add_special_tokens": False}
    )
    assert counted.status_code == 200, counted.text
    assert counted.json()["tokens"] == list(rendered().encode())
