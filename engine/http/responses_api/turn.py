"""A Responses request → the chat completion it runs as (`Turn`), or a refusal naming the field.

- `instructions` become a first `system` message (not stored: OpenAI does not carry them over);
  `previous_response_id`'s stored conversation comes before `input`, and an id the store does not
  hold is `UnknownResponse` (404).
- `input` items: messages (`input_text` / `output_text` parts joined), `function_call` items (an
  assistant message's `tool_calls`; consecutive calls share one message) and `function_call_output`
  items (`tool` messages) — so the chat template renders them as it renders chat's.
- `max_output_tokens`, `temperature`, `top_p`, `stream`, function `tools` and `tool_choice` map to the
  chat fields; tool choices follow `engine.http.tools.choice`.
- Refused by name (400): `background`, `include`, `reasoning`, `text.format` other than text,
  `truncation: auto`, `conversation`, `prompt`, `max_tool_calls`, `top_logprobs`,
  `parallel_tool_calls: false`, tools other than functions, and input items other than the three above.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, final

import msgspec

from engine.http.requests import BadBody
from engine.http.responses_api.store import MAX_RESPONSES, TTL_SECONDS, ResponseStore
from engine.http.tools.choice import tool_parser
from engine.http.tools.parsers import ParserName, Reading
from messages.openai import (
    CalledFunction,
    ChatCompletionRequest,
    ChatMessage,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ToolCallIn,
    ToolChoice,
    ToolDefinition,
)
from messages.responses_api.requests import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputContent,
    InputMessage,
    NamedFunctionChoice,
    ResponsesRequest,
)

_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")


@final
class UnknownResponse(Exception):
    """`previous_response_id` names a response the store does not hold (404)."""

    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.message = (
            f"Previous response with id {response_id!r} not found: it was never stored (store: false), "
            f"or it expired or was evicted (the node keeps the last {MAX_RESPONSES} responses, each for "
            f"{TTL_SECONDS:.0f} s)"
        )


@final
@dataclass(frozen=True, slots=True)
class Turn:
    """What one Responses request runs: `chat`, the chat completion; `conversation`, its messages as
    stored (without the instructions); `parser`, the tool-call parser of its reply (None: plain text);
    and the request's own fields the response repeats."""

    body: ResponsesRequest
    chat: ChatCompletionRequest
    conversation: list[ChatMessage]
    parser: Reading | None
    tools: list[FunctionTool]
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice


def turn(body: ResponsesRequest, store: ResponseStore, configured: ParserName | None) -> Turn:
    """See the module docstring; raises `BadBody` or `UnknownResponse`."""
    _refuse_unsupported(body)
    conversation: list[ChatMessage] = []
    if body.previous_response_id is not None:
        previous = store.conversation(body.previous_response_id)
        if previous is None:
            raise UnknownResponse(body.previous_response_id)
        conversation = previous
    if isinstance(body.input, str):
        conversation.append(ChatMessage(role="user", content=body.input))
    else:
        for index, item in enumerate(body.input):
            _append(conversation, _item(item, index))
    tools = [_tool(tool, index) for index, tool in enumerate(body.tools or [])]
    chat_tools = [
        ToolDefinition(
            function=FunctionDefinition(
                name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict
            )
        )
        for tool in tools
    ]
    choice: ToolChoice | None = None
    match body.tool_choice:
        case NamedFunctionChoice(name=name):
            choice = NamedToolChoice(function=NamedFunction(name=name))
        case other:
            choice = other
    parser = tool_parser(chat_tools or None, choice, configured)
    system = [] if body.instructions is None else [ChatMessage(role="system", content=body.instructions)]
    chat = ChatCompletionRequest(
        model=body.model,
        messages=[*system, *conversation],
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        stream=body.stream,
        tools=chat_tools or None,
        tool_choice=choice,
    )
    return Turn(
        body=body,
        chat=chat,
        conversation=conversation,
        parser=parser,
        tools=tools,
        tool_choice=body.tool_choice or ("auto" if tools else "none"),
    )


def _refuse_unsupported(body: ResponsesRequest) -> None:
    text_format = (body.text or {}).get("format") or {"type": "text"}
    checks: list[tuple[str, bool, str]] = [
        ("background", bool(body.background), "background responses are not supported"),
        ("include", bool(body.include), "include is not supported (the node returns no extra output data)"),
        ("reasoning", body.reasoning is not None, "reasoning is not supported"),
        (
            "text.format",
            not isinstance(text_format, dict) or text_format.get("type") != "text",
            "text.format other than text is not supported",
        ),
        ("truncation", body.truncation == "auto", 'truncation "auto" is not supported (use "disabled")'),
        (
            "conversation",
            body.conversation is not None,
            "conversation is not supported: use previous_response_id",
        ),
        ("prompt", body.prompt is not None, "prompt templates are not supported"),
        ("max_tool_calls", body.max_tool_calls is not None, "max_tool_calls is not supported"),
        ("top_logprobs", body.top_logprobs is not None, "top_logprobs is not supported on /v1/responses"),
        (
            "parallel_tool_calls",
            body.parallel_tool_calls is False,
            "parallel_tool_calls false is not supported: the model may make several calls",
        ),
    ]
    for param, wrong, message in checks:
        if wrong:
            raise BadBody(message, param)


def _convert(value: Any, kind: type[Any], where: str) -> Any:
    try:
        return msgspec.convert(value, type=kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _PATH.search(text)
        path = match.group("path") if match else ""
        param = f"{where}.{path}" if path and not path.startswith("[") else f"{where}{path}"
        raise BadBody(text, param) from None


def _item(item: Any, index: int) -> ChatMessage:
    where = f"input[{index}]"
    if not isinstance(item, dict):
        raise BadBody("an input item must be an object", where)
    kind = item.get("type", "message")
    match kind:
        case "message":
            message: InputMessage = _convert(item, InputMessage, where)
            role = "system" if message.role == "developer" else message.role
            return ChatMessage(role=role, content=_text(message.content))
        case "function_call":
            called: FunctionCallItem = _convert(item, FunctionCallItem, where)
            function = CalledFunction(name=called.name, arguments=called.arguments)
            return ChatMessage(
                role="assistant", tool_calls=[ToolCallIn(id=called.call_id, function=function)]
            )
        case "function_call_output":
            output: FunctionCallOutputItem = _convert(item, FunctionCallOutputItem, where)
            return ChatMessage(role="tool", content=_text(output.output), tool_call_id=output.call_id)
        case _:
            raise BadBody(
                f"input items of type {kind!r} are not supported: give messages, function_call and "
                "function_call_output items",
                f"{where}.type",
            )


def _append(conversation: list[ChatMessage], message: ChatMessage) -> None:
    """`message` after the others; a call right after another assistant call joins its message."""
    last = conversation[-1] if conversation else None
    if message.tool_calls and last is not None and last.role == "assistant" and last.tool_calls:
        conversation[-1] = msgspec.structs.replace(last, tool_calls=[*last.tool_calls, *message.tool_calls])
        return
    conversation.append(message)


def _text(content: str | list[InputContent]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _tool(tool: dict[str, Any], index: int) -> FunctionTool:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise BadBody(
            f"tools of type {kind!r} are not supported: the node runs no built-in tools; give function tools",
            f"tools[{index}].type",
        )
    converted: FunctionTool = _convert(tool, FunctionTool, f"tools[{index}]")
    return converted
