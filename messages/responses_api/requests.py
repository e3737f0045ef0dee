"""A Responses API request, `POST /v1/responses`, and its input items and function tools.

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

from messages.openai import MAX_TEXT_CHARS, Body, FunctionName, Temperature, Tokens, TopP

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
