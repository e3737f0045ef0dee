"""OpenAI request bodies → the node's `GenerateRequest`s, with every refusal a `BadBody` naming its field.

- Choices: a body asks for `n` choices of each of its prompts (completions take a list of prompts: strings
  or token-id lists), `n × prompts` at most `MAX_CHOICES`; `prompt_choices` gives one `GenerateRequest`
  per choice, choice `p * n + i` being prompt p's i-th, as OpenAI and vLLM index them. With a `seed`,
  choice i of a prompt samples with `seed + i` (vLLM's rule): the choices differ and are reproducible,
  and choice 0 is what `n=1` gives. `best_of` is accepted only where it changes nothing (equal to `n`).
- Penalties and `logit_bias` go to the node as they come (vLLM's ranges are checked on the body); the
  bias's keys must be token ids of the vocabulary.

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
from messages.control import MAX_IMAGE_SIDE, MAX_IMAGES, MAX_SEED, GenerateRequest, ImageInput
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
MAX_CHOICES: Final = 256  # n × prompts of one body


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
        (
            "best_of",
            body.best_of is not None and body.best_of != body.n,
            f"best_of other than n ({body.n}) is not supported: ask for n choices instead",
        ),
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


def _logit_bias(body: SamplingFields, vocab_size: int) -> dict[int, float]:
    bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise BadBody(
                f"logit_bias keys are token ids (integers as strings), not {key!r}", "logit_bias"
            ) from None
        if not 0 <= token < vocab_size:
            raise BadBody(
                f"logit_bias names token {token}, outside the vocabulary of {vocab_size} tokens", "logit_bias"
            )
        if not -100.0 <= value <= 100.0:
            raise BadBody(f"logit_bias[{key!r}] is {value}; a bias must be in [-100, 100]", "logit_bias")
        bias[token] = value
    return bias


def _sampling(body: SamplingFields, max_tokens: int | None, vocab_size: int) -> dict[str, Any]:
    if max_tokens is not None and body.min_tokens > max_tokens:
        raise BadBody(
            f"min_tokens ({body.min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens"
        )
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return {
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty,
        "logit_bias": _logit_bias(body, vocab_size),
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


def prompts(body: CompletionRequest) -> list[str | list[int]]:
    """A completion body's prompts: a string, a list of token ids, or a list of either (not mixed with
    bare ids), as OpenAI takes them. Each is checked non-empty; ids are checked by `completion_requests`."""
    prompt = body.prompt
    if isinstance(prompt, str):
        if not prompt:
            raise BadBody("prompt is empty", "prompt")
        return [prompt]
    if not prompt:
        raise BadBody("prompt is an empty list", "prompt")
    if all(_is_id(token) for token in prompt):
        return [list(prompt)]
    found: list[str | list[int]] = []
    for index, item in enumerate(prompt):
        if isinstance(item, str) and item:
            found.append(item)
        elif isinstance(item, list) and item and all(_is_id(token) for token in item):
            found.append(list(item))
        else:
            raise BadBody(
                f"prompt[{index}] is neither a non-empty string nor a non-empty list of token ids: a prompt "
                "is a string, a list of token ids, or a list of either",
                "prompt",
            )
    return found


def _is_id(token: object) -> bool:
    return isinstance(token, int) and not isinstance(token, bool)


def completion_requests(body: CompletionRequest, vocab_size: int) -> list[GenerateRequest]:
    """`/v1/completions`: one request per prompt (text or token ids), for its choice 0."""
    problem = unsupported(body)
    if problem is not None:
        raise problem
    sampling = _sampling(body, body.max_tokens or 16, vocab_size)
    sampling["logprobs"] = body.logprobs
    sampling["prompt_logprobs"] = body.logprobs if body.echo else None
    found = prompts(body)
    _check_choices(len(found), body.n)
    requests = []
    for number, prompt in enumerate(found):
        if isinstance(prompt, str):
            requests.append(GenerateRequest(id="http", prompt=prompt, **sampling))
            continue
        where = "prompt" if len(found) == 1 and not isinstance(body.prompt[0], list) else f"prompt[{number}]"
        for index, token in enumerate(prompt):
            if not 0 <= token < vocab_size:
                raise BadBody(
                    f"{where}[{index}] = {token} is outside the vocabulary of {vocab_size} tokens", "prompt"
                )
        requests.append(GenerateRequest(id="http", input_ids=prompt, **sampling))
    return requests


def _check_choices(prompt_count: int, n: int) -> None:
    if prompt_count * n > MAX_CHOICES:
        raise BadBody(
            f"{prompt_count} prompts × n={n} is {prompt_count * n} choices, over the {MAX_CHOICES} one request "
            "may ask for: send fewer prompts or a smaller n per request",
            "n",
        )


def prompt_choices(requests: list[GenerateRequest], n: int) -> list[list[GenerateRequest]]:
    """For each prompt's request, its `n` choices: choice i samples with `seed + i` when a seed is set
    (wrapping past the largest seed), else with a seed of the node's own, as any request without one.
    Only choice 0 asks for the prompt's log-probabilities (`echo`): the others show choice 0's, and so
    may borrow the prompt's KV instead of computing it."""
    choices = []
    for request in requests:
        seed = request.seed
        others = msgspec.structs.replace(request, prompt_logprobs=None)
        choices.append(
            [
                request
                if i == 0
                else others
                if seed is None
                else msgspec.structs.replace(others, seed=(seed + i) % (MAX_SEED + 1))
                for i in range(n)
            ]
        )
    return choices


def chat_request(body: ChatCompletionRequest, render: Render, vocab_size: int) -> GenerateRequest:
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
        **_sampling(body, max_tokens, vocab_size),
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
