"""Which requests may use tools, and how: `tool_choice` against the node's `--tool-call-parser`.

- `none` (the default without tools): the tools still reach the chat template, as on vLLM, and the
  reply is plain text.
- `auto` (the default with tools): the reply is parsed for calls by the node's parser; without
  `--tool-call-parser` the request is a 400 that says to pass it, as vLLM's is.
- `required` and a named function need constrained decoding: a 400 saying they are not supported yet.
  `tools_schema` is the JSON schema such decoding would hold the output to.
- A `tool_choice` other than `none` needs `tools` (as on OpenAI and vLLM), and a named function must
  be one of them.
"""

from __future__ import annotations

from typing import Any, assert_never

from engine.http.requests import BadBody
from engine.http.tools.parsers import ParserName
from messages.openai import NamedToolChoice, ToolChoice, ToolDefinition


def tool_parser(
    tools: list[ToolDefinition] | None, choice: ToolChoice | None, configured: ParserName | None
) -> ParserName | None:
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
            raise BadBody(
                'tool_choice "required" is not supported yet (it needs constrained decoding); use "auto"',
                "tool_choice",
            )
        case NamedToolChoice():
            if not any(tool.function.name == choice.function.name for tool in tools or ()):
                raise BadBody(
                    f"tool_choice names {choice.function.name!r}, which is not in tools", "tool_choice"
                )
            raise BadBody(
                "tool_choice naming a function is not supported yet (it needs constrained decoding); "
                'use "auto"',
                "tool_choice",
            )
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
        }
        for tool in chosen
    ]
    return {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
