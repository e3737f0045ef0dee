"""Parsed calls in OpenAI's chat shapes: a whole reply's `message` and a stream's `delta`s.

Each call gets an id `call_<24 hex>`; a stream numbers its calls from 0 (`index`) and sends each in one
delta with its id, `type`, name and whole `arguments`. A reply with calls finishes with `tool_calls`.
"""

from __future__ import annotations

import uuid
from typing import final

from engine.http.tools.parsers import CallStream, Item, ParsedCall, Reading, call_stream, parse
from messages.openai import AssistantMessage, Delta, DeltaFunction, DeltaToolCall, FunctionCall, ToolCall


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(parsed: ParsedCall) -> ToolCall:
    return ToolCall(id=call_id(), function=FunctionCall(name=parsed.name, arguments=parsed.arguments))


def assistant_message(text: str, parser: Reading | None) -> AssistantMessage:
    """A whole reply's message: `text` as it is without a parser, else its calls and the rest."""
    if parser is None:
        return AssistantMessage(content=text)
    parsed = parse(parser, text)
    return AssistantMessage(content=parsed.content, tool_calls=[tool_call(item) for item in parsed.calls])


def finish_reason(reason: str, message: AssistantMessage) -> str:
    return "tool_calls" if message.tool_calls else reason


@final
class ToolDeltas:
    """A stream's text through `parser`, as deltas: text as `content`, each call as one `tool_calls`."""

    def __init__(self, parser: Reading) -> None:
        self._stream: CallStream = call_stream(parser)
        self.calls = 0

    def feed(self, text: str) -> list[Delta]:
        return self._deltas(self._stream.feed(text))

    def finish(self) -> list[Delta]:
        return self._deltas(self._stream.finish())

    def _deltas(self, items: list[Item]) -> list[Delta]:
        deltas = []
        for item in items:
            if isinstance(item, str):
                deltas.append(Delta(content=item))
                continue
            function = DeltaFunction(name=item.name, arguments=item.arguments)
            deltas.append(
                Delta(
                    tool_calls=[
                        DeltaToolCall(index=self.calls, id=call_id(), type="function", function=function)
                    ]
                )
            )
            self.calls += 1
        return deltas
