"""OpenAI request bodies → the node's `GenerateRequest`, with every refusal a `BadBody` naming its field.

- Sampling: `temperature` defaults to 1.0 and `top_p` to 1.0, as OpenAI's do; a missing `seed` gets one
  from the node (random, or `--seed`'s sequence; as on the socket). `max_tokens` (completions: default 16)
  or `max_completion_tokens` (chat; default: what the context leaves after the prompt, as vLLM's). The
  prompt and `max_tokens` together must fit the context (`engine.generate.admission`: a 400 naming both).
- Chat: the messages are rendered with the model's chat template (`replicas.model.text.chat_template`). An
  image part (`image_url` with a `data:` URL, PNG or JPEG) becomes the model's image marker in the text
  and an `ImageInput`, so images go through the encode replicas exactly as on the socket.
- Tools: `tools` reach the chat template as its `tools` variable, an assistant message's `tool_calls`
  and a tool message's `tool_call_id` as transformers passes them (`engine.http.tools.template`); which
  `tool_choice` a request may use is `engine.http.tools.choice`'s to say.
- Log-probabilities: chat's `logprobs` (with `top_logprobs` alternatives) and completions' `logprobs`
  (that many alternatives) ask for each generated token's; completions' `echo` puts the prompt before the
  text and, with `logprobs`, the prompt tokens' log-probabilities before the generated ones' (a stream's
  first chunk carries them, once the prompt ran).
- Structured outputs (`grammar`): OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's
  `structured_outputs` (`json`, `regex`, `choice`, `grammar` — Lark —, `json_object`) and its older
  `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`: at most one, compiled here
  (`replicas.model.text.grammar`) so that one that does not compile is a 400 saying why, before
  anything is queued.
- Known fields the node does not support are refused by name (`unsupported`), never dropped.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any, Final, Protocol, assert_never, final

import msgspec

from engine.http.tools.template import template_tool_calls, template_tools
from messages.control import MAX_IMAGE_SIDE, MAX_IMAGES, GenerateRequest, ImageInput
from messages.grammar import ChoiceGrammar, Grammar, JsonGrammar, LarkGrammar, RegexGrammar
from messages.openai import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ImagePart,
    JsonObjectFormat,
    JsonSchemaResponseFormat,
    SamplingFields,
    TextFormat,
)
from replicas.model.text.grammar import grammar_name, grammar_problem

DEFAULT_TEMPERATURE: Final = 1.0
IMAGE_MARKER: Final = "<image>"  # where `replicas.model.encode_prompt` puts the next image


class Render(Protocol):
    """Chat messages → the prompt text (`engine.http.chat.renderer`); `tools` as the template sees them."""

    def __call__(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str: ...


@final
class BadBody(Exception):
    """A request body the node refuses: HTTP 400 with `param` naming the field (None: the body)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def unsupported(body: SamplingFields) -> BadBody | None:
    """The first known field set to a value the node does not support, as a `BadBody`; None if none."""
    checks: list[tuple[str, bool, str]] = [
        ("n", body.n != 1, "only n=1 is supported: send one request per choice"),
        ("best_of", body.best_of not in (None, 1), "best_of is not supported"),
        ("presence_penalty", body.presence_penalty != 0.0, "presence_penalty is not supported (use 0)"),
        ("frequency_penalty", body.frequency_penalty != 0.0, "frequency_penalty is not supported (use 0)"),
        ("repetition_penalty", body.repetition_penalty != 1.0, "repetition_penalty is not supported (use 1)"),
        ("logit_bias", bool(body.logit_bias), "logit_bias is not supported"),
    ]
    if isinstance(body, CompletionRequest):
        checks += [
            ("suffix", body.suffix is not None, "suffix is not supported"),
        ]
    if isinstance(body, ChatCompletionRequest):
        checks += [
            (
                "top_logprobs",
                body.top_logprobs is not None and not body.logprobs,
                "top_logprobs needs logprobs set to true",
            ),
        ]
    for param, wrong, message in checks:
        if wrong:
            return BadBody(message, param)
    return None


def grammar(body: SamplingFields) -> Grammar | None:
    """The body's output grammar (see the module docstring); a `BadBody` naming the field when two
    are given, or when one does not compile."""
    found: list[tuple[str, Grammar]] = []
    match body.response_format:
        case None | TextFormat():
            pass
        case JsonObjectFormat():
            found.append(("response_format", JsonGrammar()))
        case JsonSchemaResponseFormat(json_schema=schema):
            found.append(("response_format.json_schema.schema", _json(schema.json_schema)))
        case _:
            assert_never(body.response_format)
    outputs = body.structured_outputs
    if outputs is not None:
        for name, wrong in (
            ("structural_tag", outputs.structural_tag is not None),
            ("whitespace_pattern", outputs.whitespace_pattern is not None),
            ("disable_additional_properties", outputs.disable_additional_properties),
        ):
            if wrong:
                raise BadBody(f"structured_outputs.{name} is not supported", f"structured_outputs.{name}")
        if outputs.json is not None:
            found.append(("structured_outputs.json", _json(outputs.json)))
        if outputs.regex is not None:
            found.append(("structured_outputs.regex", RegexGrammar(pattern=outputs.regex)))
        if outputs.choice is not None:
            found.append(("structured_outputs.choice", ChoiceGrammar(choices=outputs.choice)))
        if outputs.grammar is not None:
            found.append(("structured_outputs.grammar", LarkGrammar(grammar=outputs.grammar)))
        if outputs.json_object:
            found.append(("structured_outputs.json_object", JsonGrammar()))
    if body.guided_json is not None:
        found.append(("guided_json", _json(body.guided_json)))
    if body.guided_regex is not None:
        found.append(("guided_regex", RegexGrammar(pattern=body.guided_regex)))
    if body.guided_choice is not None:
        found.append(("guided_choice", ChoiceGrammar(choices=body.guided_choice)))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", LarkGrammar(grammar=body.guided_grammar)))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(param for param, _ in found)
        raise BadBody(
            f"at most one structured output may be asked for; this body asks for {names}", found[1][0]
        )
    param, spec = found[0]
    try:
        spec = msgspec.convert(msgspec.to_builtins(spec), type=Grammar)  # the message's own bounds
    except msgspec.ValidationError as exc:
        raise BadBody(f"{param}: {exc}", param) from None
    problem = grammar_problem(spec)
    if problem is not None:
        raise BadBody(f"the {grammar_name(spec)} in {param} does not compile: {problem}", param)
    return spec


def _json(schema: str | dict[str, Any] | bool | None) -> JsonGrammar:
    """A JSON schema given as text or as an object (None: any JSON object)."""
    if schema is None:
        return JsonGrammar()
    return JsonGrammar(schema=schema if isinstance(schema, str) else msgspec.json.encode(schema).decode())


def _sampling(body: SamplingFields, max_tokens: int | None) -> dict[str, Any]:
    if max_tokens is not None and body.min_tokens > max_tokens:
        raise BadBody(
            f"min_tokens ({body.min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens"
        )
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return {
        "max_tokens": max_tokens,
        "temperature": DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "seed": body.seed,
        "ignore_eos": body.ignore_eos,
        "min_tokens": body.min_tokens,
        "stop": stop,
        "stream": body.stream,
        "grammar": grammar(body),
    }


def completion_request(body: CompletionRequest, vocab_size: int) -> GenerateRequest:
    """`/v1/completions`: one prompt, text or token ids."""
    problem = unsupported(body)
    if problem is not None:
        raise problem
    sampling = _sampling(body, body.max_tokens or 16)
    sampling["logprobs"] = body.logprobs
    sampling["prompt_logprobs"] = body.logprobs if body.echo else None
    prompt = body.prompt
    if isinstance(prompt, str):
        if not prompt:
            raise BadBody("prompt is empty", "prompt")
        return GenerateRequest(id="http", prompt=prompt, **sampling)
    if not prompt:
        raise BadBody("prompt is an empty list", "prompt")
    if not all(isinstance(token, int) and not isinstance(token, bool) for token in prompt):
        raise BadBody(
            "prompt must be a string or a list of token ids; a list of prompts is not supported "
            "(send one request per prompt)",
            "prompt",
        )
    for index, token in enumerate(prompt):
        if not 0 <= token < vocab_size:
            raise BadBody(
                f"prompt[{index}] = {token} is outside the vocabulary of {vocab_size} tokens", "prompt"
            )
    return GenerateRequest(id="http", input_ids=list(prompt), **sampling)


def chat_request(body: ChatCompletionRequest, render: Render) -> GenerateRequest:
    """`/v1/chat/completions`: the messages (and `tools`) rendered by `render(messages,
    add_generation_prompt, continue_final_message, tools)` into one prompt, images in order."""
    problem = unsupported(body)
    if problem is not None:
        raise problem
    images: list[ImageInput] = []
    messages = [_flatten(message, index, images) for index, message in enumerate(body.messages)]
    if body.continue_final_message and body.add_generation_prompt:
        raise BadBody(
            "continue_final_message and add_generation_prompt cannot both be true", "add_generation_prompt"
        )
    tools = template_tools(body.tools)
    prompt = render(messages, body.add_generation_prompt, body.continue_final_message, tools)
    max_tokens = body.max_completion_tokens or body.max_tokens  # None: what the context leaves
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return GenerateRequest(
        id="http",
        prompt=prompt,
        images=images,
        add_special_tokens=False,
        logprobs=logprobs,
        **_sampling(body, max_tokens),
    )


def _flatten(message: ChatMessage, index: int, images: list[ImageInput]) -> dict[str, Any]:
    """A message as chat templates take it: `content` one string, each image as the image marker."""
    content = message.content
    if isinstance(content, list):
        texts = []
        for part_index, part in enumerate(content):
            if isinstance(part, ImagePart):
                where = f"messages[{index}].content[{part_index}].image_url.url"
                if len(images) >= MAX_IMAGES:
                    raise BadBody(f"more than {MAX_IMAGES} images in one request", where)
                images.append(decode_image(part.image_url.url, where))
                texts.append(IMAGE_MARKER)
            else:
                texts.append(part.text)
        content = "".join(texts)
    flat: dict[str, Any] = {"role": message.role, "content": content if content is not None else ""}
    if message.name is not None:
        flat["name"] = message.name
    if message.tool_calls:
        flat["tool_calls"] = template_tool_calls(message.tool_calls)
    if message.tool_call_id is not None:
        flat["tool_call_id"] = message.tool_call_id
    return flat


def decode_image(url: str, where: str) -> ImageInput:
    """A `data:image/png;base64,...` or JPEG URL as raw RGB (`ImageInput`); other URLs are refused: the
    node fetches nothing from the network."""
    header, comma, data = url.partition(",")
    if not url.startswith("data:") or not comma:
        raise BadBody("only data: URLs are supported for images (the node fetches nothing)", where)
    if not header.endswith(";base64") or header[5:].split(";")[0] not in (
        "image/png",
        "image/jpeg",
        "image/jpg",
    ):
        raise BadBody("an image must be a base64 data: URL of image/png or image/jpeg", where)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise BadBody("the image's base64 data does not decode", where) from None
    from PIL import Image, UnidentifiedImageError  # only when images come

    try:
        with Image.open(io.BytesIO(raw)) as image:
            if image.format not in ("PNG", "JPEG"):
                raise BadBody(f"the image is {image.format}, not PNG or JPEG", where)
            rgb = image.convert("RGB")
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise BadBody(f"the image cannot be read: {exc}", where) from None
    if max(rgb.width, rgb.height) > MAX_IMAGE_SIDE:
        raise BadBody(f"the image is {rgb.width}x{rgb.height}; sides may be at most {MAX_IMAGE_SIDE}", where)
    return ImageInput(width=rgb.width, height=rgb.height, pixels=rgb.tobytes())
