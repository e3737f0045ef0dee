"""The tool-call parsers on fixed model text: Hermes' `<tool_call>` tags (as Qwen2.5 writes them) and
Llama 3's JSON calls, as a whole and fed in pieces — every split of the text gives the same calls and
text — and a chat stream's deltas assembled back into the whole reply."""

from __future__ import annotations

import json

import msgspec
import pytest

from engine.http.requests import BadBody
from engine.http.tools.calls import ToolDeltas, assistant_message
from engine.http.tools.choice import tool_parser, tools_schema
from engine.http.tools.parsers import Parsed, ParsedCall, ParserName, call_stream, joined, parse
from messages.openai import NamedFunction, NamedToolChoice, ToolDefinition

WEATHER = ParsedCall(name="get_weather", arguments='{"city": "Paris"}')
TIME = ParsedCall(name="get_time", arguments='{"zone": "CET", "precise": true}')

HERMES = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", "precise": true}}\n</tool_call>'
)
LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"zone": "CET", "precise": true}}'

CASES: list[tuple[ParserName, str, str | None, tuple[ParsedCall, ...]]] = [
    ("hermes", HERMES, "Let me check.", (WEATHER, TIME)),
    ("hermes", "no calls here, just < and <tool and text", "no calls here, just < and <tool and text", ()),
    ("hermes", '  <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}', None, (WEATHER,)),
    ("hermes", "<tool_call>{not json}</tool_call> after", "<tool_call>{not json}</tool_call> after", ()),
    (
        "hermes",
        'a <tool_call>{"arguments": {}}</tool_call>',
        'a <tool_call>{"arguments": {}}</tool_call>',
        (),
    ),
    (
        "hermes",
        'before <tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call> after',
        "beforeafter",
        (WEATHER,),
    ),
    ("llama3_json", LLAMA, None, (WEATHER, TIME)),
    ("llama3_json", "<|python_tag|>" + LLAMA.split(";")[0], None, (WEATHER,)),
    ("llama3_json", "The weather is nice.", "The weather is nice.", ()),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": ',
        '{"name": "get_weather", "parameters": {"city": ',
        (),
    ),
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', ()),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_a_whole_reply_parses_into_text_and_calls(
    parser: ParserName, text: str, content: str | None, calls: tuple[ParsedCall, ...]
) -> None:
    parsed = parse(parser, text)
    assert (parsed.content, parsed.calls) == (content, calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_any_split_of_the_text_parses_the_same(
    parser: ParserName, text: str, content: str | None, calls: tuple[ParsedCall, ...]
) -> None:
    for size in (1, 2, 3, 7):
        stream = call_stream(parser)
        items = []
        for start in range(0, len(text), size):
            items += stream.feed(text[start : start + size])
        items += stream.finish()
        assert joined(items) == parse(parser, text), size
    for cut in range(len(text) + 1):
        stream = call_stream(parser)
        items = [*stream.feed(text[:cut]), *stream.feed(text[cut:]), *stream.finish()]
        assert joined(items) == parse(parser, text), cut


def test_a_stream_holds_back_only_what_may_be_a_call() -> None:
    stream = call_stream("hermes")
    assert stream.feed("Hello <tool") == ["Hello"]  # the space may precede a call: held with the tag
    assert stream.feed("s> more") == [" <tools> more"]
    assert stream.feed(' <tool_call>{"name": "get_weather", ') == []
    assert stream.feed('"arguments": {"city": "Paris"}}</tool_call>') == [WEATHER]
    assert stream.finish() == []


def test_stream_deltas_add_up_to_the_whole_message() -> None:
    deltas = ToolDeltas("hermes")
    chunks = []
    for start in range(0, len(HERMES), 5):
        chunks += deltas.feed(HERMES[start : start + 5])
    chunks += deltas.finish()
    content = "".join(delta.content or "" for delta in chunks)
    calls = [call for delta in chunks for call in delta.tool_calls or []]
    whole = assistant_message(HERMES, "hermes")
    assert content == whole.content
    assert [call.index for call in calls] == [0, 1]
    assert [(call.function.name, call.function.arguments) for call in calls] == [
        (call.function.name, call.function.arguments) for call in whole.tool_calls
    ]
    assert all(call.id and call.id.startswith("call_") and call.type == "function" for call in calls)
    assert len({call.id for call in calls}) == 2
    assert deltas.calls == 2
    for call in whole.tool_calls:
        assert isinstance(json.loads(call.function.arguments), dict)


def test_a_message_without_a_parser_is_the_text() -> None:
    message = assistant_message(HERMES, None)
    assert (message.content, message.tool_calls) == (HERMES, [])


TOOLS = msgspec.convert(
    [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    type=list[ToolDefinition],
)


def test_tool_choice_against_the_configured_parser() -> None:
    assert tool_parser(TOOLS, None, "hermes") == "hermes"
    assert tool_parser(TOOLS, "auto", "llama3_json") == "llama3_json"
    assert tool_parser(TOOLS, "none", None) is None
    assert tool_parser(None, None, None) is None
    assert tool_parser(None, "none", "hermes") is None
    with pytest.raises(BadBody, match="needs tools"):
        tool_parser(None, "auto", "hermes")
    with pytest.raises(BadBody, match="--tool-call-parser") as refused:
        tool_parser(TOOLS, None, None)
    assert refused.value.param == "tool_choice"
    assert tool_parser(TOOLS, "required", None) == "forced"  # held to calls: no parser flag needed
    named = NamedToolChoice(function=NamedFunction(name="get_weather"))
    assert tool_parser(TOOLS, named, "hermes") == "forced"
    with pytest.raises(BadBody, match="not in tools"):
        tool_parser(TOOLS, NamedToolChoice(function=NamedFunction(name="other")), "hermes")


def test_a_forced_reply_is_read_as_its_list_of_calls() -> None:
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "f", "parameters": {}}]'
    for pieces in ([text], [text[:7], text[7:30], text[30:]]):
        stream = call_stream("forced")
        assert [item for piece in pieces for item in stream.feed(piece)] == []  # held to the end
        assert stream.finish() == [
            ParsedCall("get_weather", '{"city": "Paris"}'),
            ParsedCall("f", "{}"),
        ]
    cut = text[:40]  # max_tokens ended it mid-list: the text as the model wrote it
    assert parse("forced", cut) == Parsed(content=cut, calls=())
    assert parse("forced", '{"name": "f"}') == Parsed(content='{"name": "f"}', calls=())


def test_the_schema_of_required_calls_names_each_tool() -> None:
    schema = tools_schema(TOOLS)
    assert schema["minItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
