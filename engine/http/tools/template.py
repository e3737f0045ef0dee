"""What a chat template sees of tools, as transformers' `apply_chat_template(tools=...)` and vLLM give it.

- `tools`: each `{"type": "function", "function": {"name", "description", "parameters"}}`, fields the
  client left out absent.
- An assistant message's `tool_calls`: `{"id", "type": "function", "function": {"name", "arguments"}}`
  with `arguments` decoded into an object when it is one (Llama 3's and Qwen2.5's templates write it
  with `tojson`, and would otherwise quote the client's string a second time); a tool message keeps its
  `tool_call_id`.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from messages.openai import ToolCallIn, ToolDefinition


def template_tools(tools: list[ToolDefinition] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    rendered = []
    for tool in tools:
        function = {
            key: value for key, value in msgspec.to_builtins(tool.function).items() if value is not None
        }
        rendered.append({"type": tool.type, "function": function})
    return rendered


def template_tool_calls(calls: list[ToolCallIn]) -> list[dict[str, Any]]:
    rendered = []
    for call in calls:
        arguments: Any = call.function.arguments
        try:
            decoded = json.loads(arguments)
        except json.JSONDecodeError:
            decoded = None
        if isinstance(decoded, dict):
            arguments = decoded
        function = {"name": call.function.name, "arguments": arguments}
        entry: dict[str, Any] = {"type": "function", "function": function}
        if call.id is not None:
            entry["id"] = call.id
        rendered.append(entry)
    return rendered
