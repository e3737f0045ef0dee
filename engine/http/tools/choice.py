"""Which requests may use tools, and how: `tool_choice` against the node's `--tool-call-parser`.

- `none` (the default without tools): the tools still reach the chat template, as on vLLM, and the
  reply is plain text.
- `auto` (the default with tools): the reply is parsed for calls by the node's parser; without
  `--tool-call-parser` the request is a 400 that says to pass it, as vLLM's is.
- `required` and a named function: the output is held to a JSON list of calls — of any of the tools, or
  of the named one — by the structured-output machinery (`forced_calls`: the request's grammar is the
  JSON schema `tools_schema` gives), and read back as calls (`forced`), as vLLM does it; no parser flag is
  needed. Such a request cannot also ask for a structured output of its own.
- A `tool_choice` other than `none` needs `tools` (as on OpenAI and vLLM), and a named function must
  be one of them.
"""

from __future__ import annotations

import json
from typing import Any, assert_never

import msgspec

from engine.http.requests import BadBody
from engine.http.tools.parsers import ParserName, Reading
from messages.control import GenerateRequest
from messages.grammar import JsonGrammar
from messages.openai import NamedToolChoice, ToolChoice, ToolDefinition


def tool_parser(
    tools: list[ToolDefinition] | None, choice: ToolChoice | None, configured: ParserName | None
) -> Reading | None:
    """The parser the reply goes through (None: plain text), or `BadBody` naming `tool_choice` or `tools`."""
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise BadBody("tool_choice other than none needs tools: give the functions in tools", "tool_choice")
    match choice:
        case "none":
            return None
        case "auto":
            if configured is None:
                raise BadBody(
                    'tool_choice "auto" needs a tool-call parser: start the node with --tool-call-parser '
                    'hermes (Qwen2.5, Hermes) or llama3_json (Llama 3.x), or send tool_choice "none"',
                    "tool_choice",
                )
            return configured
        case "required":
            return "forced"
        case NamedToolChoice():
            if not any(tool.function.name == choice.function.name for tool in tools or ()):
                raise BadBody(
                    f"tool_choice names {choice.function.name!r}, which is not in tools", "tool_choice"
                )
            return "forced"
        case _:
            assert_never(choice)


def tools_schema(tools: list[ToolDefinition], name: str | None = None) -> dict[str, Any]:
    """The JSON schema of a reply that is a list of calls to `tools` (or to `name` alone), at least one,
    each `{"name": ..., "parameters": {...}}` — what `required` and a named function constrain to."""
    chosen = [tool for tool in tools if name is None or tool.function.name == name]
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": tool.function.parameters or {"type": "object"},
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in chosen
    ]
    return {"type": "array", "minItems": 1, "items": {"anyOf": variants}}


def forced_calls(
    prompts: list[GenerateRequest], tools: list[ToolDefinition] | None, choice: ToolChoice | None
) -> list[GenerateRequest]:
    """`prompts` with their output held to a list of calls when `choice` is `required` or names a
    function (`tools_schema`'s JSON schema as their grammar); as they are otherwise. `BadBody` when a
    prompt asks for a structured output of its own as well."""
    match choice:
        case "required":
            schema = tools_schema(tools or [])
        case NamedToolChoice():
            schema = tools_schema(tools or [], choice.function.name)
        case None | "none" | "auto":
            return prompts
        case _:
            assert_never(choice)
    if any(prompt.grammar is not None for prompt in prompts):
        raise BadBody(
            "tool_choice required or naming a function holds the reply to tool calls; it cannot be "
            "combined with response_format or structured_outputs",
            "tool_choice",
        )
    grammar = JsonGrammar(schema=json.dumps(schema))
    return [msgspec.structs.replace(prompt, grammar=grammar) for prompt in prompts]
