"""The bodies of OpenAI's Responses API, `POST /v1/responses` (docs/http-api.md#the-responses-api).

A request's `input` is a string or a list of items: messages (`role`, `content` a string or
`input_text` / `output_text` parts; `type` "message" or left out), `function_call` items (a call an
earlier reply made) and `function_call_output` items (its result). Items are decoded one by one
(`engine.http.responses_api.turn`), so an item of a kind the node does not take is a 400 naming it.
Fields the node does not support are decoded too, so each is refused by name rather than dropped; other
unknown fields are ignored, as in `messages.openai`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from messages.openai import MAX_TEXT_CHARS, Body, FunctionName, Reply, Temperature, Tokens, TopP

Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)]
MAX_INPUT_ITEMS = 4096


class InputText(Body, frozen=True, kw_only=True, tag="input_text", tag_field="type"):
    text: Text


class OutputTextIn(Body, frozen=True, kw_only=True, tag="output_text", tag_field="type"):
    """An earlier reply's text, sent back in an assistant message."""

    text: Text


InputContent = InputText | OutputTextIn


class InputMessage(Body, frozen=True, kw_only=True):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[InputContent]


class FunctionCallItem(Body, frozen=True, kw_only=True):
    type: Literal["function_call"] = "function_call"
    call_id: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    arguments: Text
    id: str | None = None


class FunctionCallOutputItem(Body, frozen=True, kw_only=True):
    type: Literal["function_call_output"] = "function_call_output"
    call_id: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    output: Text | list[InputContent]


class FunctionTool(Body, frozen=True, kw_only=True):
    """A function tool, as the Responses API spells it (flat: no `function` object)."""

    type: Literal["function"] = "function"
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(Body, frozen=True, kw_only=True):
    type: Literal["function"]
    name: FunctionName


class ResponsesRequest(Body, frozen=True, kw_only=True):
    """`POST /v1/responses`."""

    model: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)] | None = None
    input: Text | Annotated[list[Any], msgspec.Meta(min_length=1, max_length=MAX_INPUT_ITEMS)]
    instructions: Text | None = None
    max_output_tokens: Tokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    tools: list[dict[str, Any]] | None = None  # each decoded as a `FunctionTool`, or refused by type
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    # Known, refused when set (`engine.http.responses_api.turn`).
    background: bool | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None


# ---------------------------------------------------------------------- responses
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

    type: str
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartEvent(Reply, frozen=True, kw_only=True):
    """`response.content_part.added` / `.done`."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class TextDeltaEvent(Reply, frozen=True, kw_only=True):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class TextDoneEvent(Reply, frozen=True, kw_only=True):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ArgumentsDeltaEvent(Reply, frozen=True, kw_only=True):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(Reply, frozen=True, kw_only=True):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    sequence_number: int
    item_id: str
    output_index: int
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
