"""The model's text → plain text and tool calls, per chat-template family (`--tool-call-parser`, as vLLM's).

- `hermes`: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, anywhere in the text,
  as Qwen2.5 and Hermes models emit them; a call left open at the end of the text counts when its JSON
  is whole (the model stopped right before `</tool_call>`).
- `llama3_json`: the whole reply is one or more `{"name": ..., "parameters": {...}}` objects (`;` between
  them), optionally after `<|python_tag|>`, as Llama 3.x emits them; anything else is plain text.

A call whose JSON does not parse, or lacks a string `name` or an object of arguments, stays text: the
client sees what the model wrote. Whitespace between text and a call belongs to neither.

`forced` reads a reply that `tool_choice` `required` or a named function held to a JSON list of calls
(`engine.http.tools.choice`): `[{"name": ..., "parameters": {...}}, ...]`; all of it is held back until
the end, then each element is a call (a reply that is not such a list — cut by `max_tokens` — stays text).

All parse incrementally (`feed` each piece of text, then `finish`) and return `Item`s in order: text
to show now, or a whole call. Text that may still turn out to be part of a call — from the start of a
`<tool_call>` (or a prefix of it) to its end; for `llama3_json` a reply that starts like JSON — is held
back until that is known, so a stream shows each call whole, once. Feeding a text in any pieces gives
the same items, joined, as feeding it at once (`parse`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol, assert_never, final

from engine.config import ToolCallParser as ParserName

Reading = ParserName | Literal["forced"]  # how a reply is read for calls: a family's parser, or forced

HERMES_START: Final = "<tool_call>"
HERMES_END: Final = "</tool_call>"
PYTHON_TAG: Final = "<|python_tag|>"


@final
@dataclass(frozen=True, slots=True)
class ParsedCall:
    """A call the model made: the function's `name` and its `arguments`, a JSON object as text."""

    name: str
    arguments: str


Item = str | ParsedCall


@final
@dataclass(frozen=True, slots=True)
class Parsed:
    """A whole reply: its text outside the calls (None when there is none) and the calls, in order."""

    content: str | None
    calls: tuple[ParsedCall, ...]


class CallStream(Protocol):
    def feed(self, text: str) -> list[Item]: ...

    def finish(self) -> list[Item]: ...


def call_stream(name: Reading) -> CallStream:
    match name:
        case "hermes":
            return HermesStream()
        case "llama3_json":
            return Llama3JsonStream()
        case "forced":
            return ForcedStream()
        case _:
            assert_never(name)


def parse(name: Reading, text: str) -> Parsed:
    """`text`, a whole reply, parsed by the parser `name`."""
    stream = call_stream(name)
    return joined([*stream.feed(text), *stream.finish()])


def joined(items: list[Item]) -> Parsed:
    content = "".join(item for item in items if isinstance(item, str))
    calls = tuple(item for item in items if isinstance(item, ParsedCall))
    return Parsed(content=content or None, calls=calls)


def call(value: Any, arguments_key: str = "arguments") -> ParsedCall | None:
    """A decoded `{"name": ..., "<arguments_key>": {...}}` as a call; None when it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(name=value["name"], arguments=json.dumps(arguments, ensure_ascii=False))


def _held_prefix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper prefix of `marker`."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


@final
class HermesStream:
    """`<tool_call>{json}</tool_call>` (see the module docstring)."""

    def __init__(self) -> None:
        self._pending = ""
        self._after_call = False  # whitespace right after a call is dropped

    def feed(self, text: str) -> list[Item]:
        self._pending += text
        return self._take(final=False)

    def finish(self) -> list[Item]:
        return self._take(final=True)

    def _text(self, text: str, items: list[Item]) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        if text:
            items.append(text)

    def _take(self, *, final: bool) -> list[Item]:
        items: list[Item] = []
        while True:
            pending = self._pending
            start = pending.find(HERMES_START)
            if start < 0:
                hold = 0 if final else _held_prefix(pending, HERMES_START)
                shown = pending[: len(pending) - hold]
                if not final:  # whitespace before a call that may follow belongs to neither
                    stripped = shown.rstrip()
                    hold += len(shown) - len(stripped)
                    shown = stripped
                self._text(shown, items)
                self._pending = pending[len(pending) - hold :]
                return items
            end = pending.find(HERMES_END, start)
            if end < 0 and not final:
                before = pending[:start].rstrip()  # the whitespace waits with the call
                self._text(before, items)
                self._pending = pending[len(before) :]
                return items
            body = pending[start + len(HERMES_START) : end if end >= 0 else len(pending)]
            rest = pending[end + len(HERMES_END) :] if end >= 0 else ""
            parsed = _decoded_call(body)
            if parsed is None:  # not a call: the model's text as it wrote it
                self._text(pending[: end + len(HERMES_END) if end >= 0 else len(pending)], items)
                self._after_call = False
            else:
                self._text(pending[:start].rstrip(), items)
                items.append(parsed)
                self._after_call = True
            self._pending = rest
            if not rest:
                return items


def _decoded_call(body: str) -> ParsedCall | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    return call(value)


@final
class Llama3JsonStream:
    """A reply of `{"name": ..., "parameters": {...}}` objects (see the module docstring)."""

    def __init__(self) -> None:
        self._pending = ""
        self._mode: Literal["unknown", "json", "text"] = "unknown"

    def feed(self, text: str) -> list[Item]:
        if self._mode == "text":
            return [text] if text else []
        self._pending += text
        if self._mode == "json":
            return []
        head = self._pending.lstrip()
        if not head or PYTHON_TAG.startswith(head):
            return []
        if head.startswith(("{", PYTHON_TAG)):
            self._mode = "json"
            return []
        self._mode = "text"
        pending, self._pending = self._pending, ""
        return [pending]

    def finish(self) -> list[Item]:
        pending, self._pending = self._pending, ""
        if self._mode != "json":
            return [pending] if pending else []
        calls = _json_calls(pending)
        return [pending] if calls is None else list(calls)


@final
class ForcedStream:
    """A reply held to a JSON list of calls (see the module docstring): nothing until the end."""

    def __init__(self) -> None:
        self._pending = ""

    def feed(self, text: str) -> list[Item]:
        self._pending += text
        return []

    def finish(self) -> list[Item]:
        pending, self._pending = self._pending, ""
        try:
            value = json.loads(pending)
        except json.JSONDecodeError:
            return [pending] if pending else []
        calls = [call(item, "parameters") for item in value] if isinstance(value, list) else [None]
        if not calls or any(parsed is None for parsed in calls):
            return [pending]
        return [parsed for parsed in calls if parsed is not None]


def _json_calls(text: str) -> list[ParsedCall] | None:
    """`{...}; {...}` (after an optional `<|python_tag|>`) as calls; None unless it is wholly that."""
    text = text.strip()
    if text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG) :].lstrip()
    decoder = json.JSONDecoder()
    calls: list[ParsedCall] = []
    position = 0
    while position < len(text):
        try:
            value, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return None
        parsed = call(value, "parameters")
        if parsed is None:
            return None
        calls.append(parsed)
        position = end
        while position < len(text) and (text[position].isspace() or text[position] == ";"):
            position += 1
    return calls or None
