"""What `POST /v1/responses` answers: a response (its output items: a message, function calls) and the
events of a streamed one, in OpenAI's shapes; written, never read by the node."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from messages.openai import Reply
from messages.responses_api.requests import FunctionTool, NamedFunctionChoice


class OutputText(Reply, frozen=True, kw_only=True):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class OutputMessage(Reply, frozen=True, kw_only=True):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(Reply, frozen=True, kw_only=True):
    id: str
    type: Literal["function_call"] = "function_call"
    status: Literal["in_progress", "completed", "incomplete"]
    call_id: str
    name: str
    arguments: str


OutputItem = OutputMessage | OutputFunctionCall


class InputTokensDetails(Reply, frozen=True, kw_only=True):
    cached_tokens: int


class OutputTokensDetails(Reply, frozen=True, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(Reply, frozen=True, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(Reply, frozen=True, kw_only=True):
    reason: Literal["max_output_tokens"]


class ResponseObject(Reply, frozen=True, kw_only=True):
    """A response, whole or (in a stream's first events) in progress."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[OutputItem]
    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    tools: list[FunctionTool]
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["disabled"] = "disabled"
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    usage: ResponseUsage | None = None


class ResponseEvent(Reply, frozen=True, kw_only=True):
    """`response.created`, `response.in_progress`, `response.completed`, `response.incomplete`."""

    type: str
    sequence_number: int
    response: ResponseObject


class OutputItemEvent(Reply, frozen=True, kw_only=True):
    """`response.output_item.added` / `.done`."""

    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartEvent(Reply, frozen=True, kw_only=True):
    """`response.content_part.added` / `.done`."""

    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class _TextEvent(Reply, frozen=True, kw_only=True):
    """What both events of a message's text name: the item, its place in the output and in its content."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int


class TextDeltaEvent(_TextEvent, frozen=True, kw_only=True):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    delta: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class TextDoneEvent(_TextEvent, frozen=True, kw_only=True):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    text: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class _ArgumentsEvent(Reply, frozen=True, kw_only=True):
    """What both events of a function call's arguments name: the item and its place in the output."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int


class ArgumentsDeltaEvent(_ArgumentsEvent, frozen=True, kw_only=True):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    delta: str


class ArgumentsDoneEvent(_ArgumentsEvent, frozen=True, kw_only=True):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    name: str
    arguments: str


class ErrorEvent(Reply, frozen=True, kw_only=True):
    """A failure after the stream began; the stream ends after it."""

    type: Literal["error"] = "error"
    sequence_number: int
    code: str
    message: str
    param: str | None = None


StreamEvent = (
    ResponseEvent
    | OutputItemEvent
    | ContentPartEvent
    | TextDeltaEvent
    | TextDoneEvent
    | ArgumentsDeltaEvent
    | ArgumentsDoneEvent
    | ErrorEvent
)
