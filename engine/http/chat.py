"""Chat messages → one prompt, with the model's chat template (`replicas.model.text.chat_template`).

`continue_final_message` renders without a generation prompt and cuts the text right after the last
message's content, as transformers' `apply_chat_template` does, so the model continues that message.
The rendered prompt already holds the template's special tokens: it is tokenized without adding more.
"""

from __future__ import annotations

from typing import Any

from engine.http.requests import BadBody, Render
from replicas.model.text.chat_template import ChatTemplate, ChatTemplateError


def renderer(template: ChatTemplate | None, model: str) -> Render:
    """A `render(messages, add_generation_prompt, continue_final_message, tools)` for `template`; one that
    refuses with a 400 when the model has none."""

    def render(
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if template is None:
            raise BadBody(f"model {model!r} has no chat template: use /v1/completions", "messages")
        try:
            text = template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        except ChatTemplateError as exc:
            raise BadBody(str(exc), "messages") from None
        if not continue_final_message:
            return text
        final = str(messages[-1].get("content") or "")
        if not final.strip() or final.strip() not in text:
            raise BadBody(
                "continue_final_message: the final message's content is not in the prompt", "messages"
            )
        end = text.rindex(final.strip()) + len(final.strip())
        return text[:end]

    return render
