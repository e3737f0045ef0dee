"""vLLM's utility routes beside the OpenAI API: `/tokenize`, `/detokenize`, `/version`, and what an
unknown route answers.

`/tokenize` takes a `prompt` (special tokens added unless `add_special_tokens` is false) or chat
`messages` and `tools` (rendered by the chat template, as `/v1/chat/completions` renders them; text only) and answers
`count`, `max_model_len` and `tokens`, as vLLM does; `/detokenize` answers `prompt` for `tokens`. Both
take an optional `model`, one the node serves. `/version` answers zigzag's version. A path no route
serves gets OpenAI's JSON error with 404 (a known path with another method: 405), never plain text.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any, final

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from engine.generate.served import ServedModel
from engine.http.errors import error_response, validation_response
from engine.http.requests import BadBody, Render
from engine.http.tools.template import template_tool_calls, template_tools
from messages.openai import (
    ChatMessage,
    DetokenizeReply,
    DetokenizeRequest,
    TextPart,
    TokenizeReply,
    TokenizeRequest,
    VersionReply,
)
from replicas.model import Tokenizer

JSON = "application/json"


def version() -> str:
    try:
        return metadata.version("zigzag")
    except metadata.PackageNotFoundError:
        return "unknown"


@final
class TokenRoutes:
    """The routes above, for one node's served model (`served`), `tokenizer` and chat `render`."""

    def __init__(self, served: ServedModel, tokenizer: Tokenizer | None, render: Render) -> None:
        self._served = served
        self._tokenizer = tokenizer
        self._render = render

    async def tokenize(self, request: Request) -> Response:
        body = await _decode(request, TokenizeRequest)
        if isinstance(body, Response):
            return body
        try:
            ids = self._ids(body)
        except BadBody as exc:
            return _refused(exc)
        reply = TokenizeReply(count=len(ids), max_model_len=self._served.context, tokens=ids)
        return Response(msgspec.json.encode(reply), media_type=JSON)

    async def detokenize(self, request: Request) -> Response:
        body = await _decode(request, DetokenizeRequest)
        if isinstance(body, Response):
            return body
        try:
            text = self._text(body)
        except BadBody as exc:
            return _refused(exc)
        return Response(msgspec.json.encode(DetokenizeReply(prompt=text)), media_type=JSON)

    def _ids(self, body: TokenizeRequest) -> list[int]:
        tokenizer = self._checked(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise BadBody("give either prompt or messages", "prompt")
        if body.prompt is not None:
            return list(tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        assert body.messages is not None
        messages = [_text_message(message, index) for index, message in enumerate(body.messages)]
        text = self._render(messages, body.add_generation_prompt, False, template_tools(body.tools))
        return list(tokenizer.encode(text, add_special_tokens=False))

    def _text(self, body: DetokenizeRequest) -> str:
        tokenizer = self._checked(body.model)
        vocab = tokenizer.vocab_size
        for index, token in enumerate(body.tokens):
            if not 0 <= token < vocab:
                raise BadBody(
                    f"tokens[{index}] = {token} is outside the vocabulary of {vocab} tokens", "tokens"
                )
        return tokenizer.decode(body.tokens)

    async def version(self, request: Request) -> Response:
        return Response(msgspec.json.encode(VersionReply(version=version())), media_type=JSON)

    def _checked(self, model: str | None) -> Tokenizer:
        names = self._served.names
        if model is not None and model not in names:
            served = " or ".join(repr(name) for name in names)
            raise BadBody(f"the model {model!r} does not exist; this node serves {served}", "model")
        if self._tokenizer is None:
            raise BadBody(f"model {self._served.name!r} has no tokenizer: send token ids", "prompt")
        return self._tokenizer


def _refused(exc: BadBody) -> Response:
    return error_response(404 if exc.param == "model" else 400, exc.message, exc.param)


async def _decode(request: Request, kind: type[Any]) -> Any:
    try:
        return msgspec.json.decode(await request.body(), type=kind)
    except msgspec.ValidationError as exc:
        return validation_response(exc)
    except msgspec.DecodeError as exc:
        return error_response(400, f"the body is not valid JSON: {exc}", None)


def _text_message(message: ChatMessage, index: int) -> dict[str, Any]:
    flat: dict[str, Any] = {"role": message.role}
    if message.tool_calls:
        flat["tool_calls"] = template_tool_calls(message.tool_calls)
    if message.tool_call_id is not None:
        flat["tool_call_id"] = message.tool_call_id
    content = message.content
    if content is None or isinstance(content, str):
        return {**flat, "content": content or ""}
    texts = []
    for part_index, part in enumerate(content):
        if not isinstance(part, TextPart):
            raise BadBody("/tokenize takes text messages only", f"messages[{index}].content[{part_index}]")
        texts.append(part.text)
    return {**flat, "content": "".join(texts)}


async def not_found(request: Request, exc: Exception) -> Response:
    """OpenAI's JSON error for a route that does not exist (404) or a method it does not take (405)."""
    status = exc.status_code if isinstance(exc, HTTPException) else 404
    if status == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    else:
        message = (
            f"no route {request.method} {request.url.path}; this node serves /v1/completions, "
            "/v1/chat/completions, /v1/responses, /v1/models, /tokenize, /detokenize, /version, /health and /metrics"
        )
    return error_response(status, message, None)
