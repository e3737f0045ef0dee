"""The bodies of the OpenAI-compatible HTTP API (docs/http-api.md): requests in, responses out.

Unlike the control socket's messages, request bodies ignore fields they do not know, as OpenAI's and
vLLM's servers do: clients and load generators send many optional fields. Fields that are known but not
supported (`suffix`, `best_of` other than `n`, ...) are refused with a 400 that names them
(`engine.http.requests.unsupported`), never silently dropped. Numbers are bounded here, so a bad body is
a 400 naming the field, not an error deep inside the node.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from messages.control import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_NEW_TOKENS,
    MAX_SEED,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    Penalty,
    RepetitionPenalty,
)
from messages.grammar import MAX_CHOICE_CHARS, MAX_CHOICES, MAX_GRAMMAR_CHARS

MAX_MESSAGES = 4096
MAX_TEXT_CHARS = 16 * 1024 * 1024
MAX_URL_CHARS = 64 * 1024 * 1024

Stop = (
    Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_CHARS)]
    | Annotated[
        list[Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_CHARS)]],
        msgspec.Meta(max_length=MAX_STOP_STRINGS),
    ]
    | None
)
Tokens = Annotated[int, msgspec.Meta(ge=1, le=MAX_NEW_TOKENS)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TEMPERATURE)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
Seed = Annotated[int, msgspec.Meta(ge=0, le=MAX_SEED)]
Logprobs = Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)]


class Body(msgspec.Struct, frozen=True, kw_only=True):
    """Base of request bodies: unknown fields are ignored (see the module docstring)."""


class StreamOptions(Body, frozen=True, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(Body, frozen=True, kw_only=True):
    """OpenAI's `response_format.json_schema`: the answer validates against `schema` (`strict` is taken
    as true: the grammar enforces the schema in every case)."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    # `schema` on the wire; None: any JSON object
    json_schema: dict[str, Any] | bool | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None
    description: str | None = None


class TextFormat(Body, frozen=True, kw_only=True, tag="text", tag_field="type"):
    """Free text (no constraint)."""


class JsonObjectFormat(Body, frozen=True, kw_only=True, tag="json_object", tag_field="type"):
    """Any JSON object."""


class JsonSchemaResponseFormat(Body, frozen=True, kw_only=True, tag="json_schema", tag_field="type"):
    json_schema: JsonSchemaFormat


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaResponseFormat


class StructuredOutputs(Body, frozen=True, kw_only=True):
    """vLLM's `structured_outputs`: exactly one of these constrains the answer. `grammar` is a Lark
    grammar (llguidance's dialect); `structural_tag`, `whitespace_pattern` and
    `disable_additional_properties` are known and refused."""

    json: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | dict[str, Any] | None = (
        None
    )
    regex: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | None = None
    choice: (
        Annotated[
            list[Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CHOICE_CHARS)]],
            msgspec.Meta(min_length=1, max_length=MAX_CHOICES),
        ]
        | None
    ) = None
    grammar: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | None = None
    json_object: bool | None = None
    # Accepted: JSON never has free whitespace here, and there is no other backend to fall back to.
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    # Refused when set (engine.http.requests).
    structural_tag: Any = None
    whitespace_pattern: str | None = None
    disable_additional_properties: bool = False


class SamplingFields(Body, frozen=True, kw_only=True):
    """What completions and chat completions share."""

    # None: the served model, as vLLM takes a body without one.
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=128)] = 1
    stop: Stop = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_NEW_TOKENS)] = 0
    # vLLM's ranges; logit_bias maps token ids (as strings) to the value added to their logits.
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    # (its keys and values are checked in `engine.http.requests`, so a 400 names the token).
    logit_bias: Annotated[dict[str, float], msgspec.Meta(max_length=MAX_LOGIT_BIAS)] | None = None
    # Accepted only equal to n (a 400 names it otherwise).
    best_of: int | None = None
    user: str | None = None
    # Structured outputs (engine.http.requests): OpenAI's `response_format`, vLLM's `structured_outputs`
    # and its older `guided_*` spellings; at most one of them.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields, frozen=True, kw_only=True):
    """`POST /v1/completions`: a prompt as text or token ids, or a list of prompts (each text or token ids)."""

    # Text, token ids, or a list of either (`engine.http.requests.prompts` checks the shapes).
    prompt: Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)] | list[Any]
    max_tokens: Tokens | None = 16
    echo: bool = False
    logprobs: Logprobs | None = None
    suffix: str | None = None


class ImageUrl(Body, frozen=True, kw_only=True):
    url: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_URL_CHARS)]
    detail: str | None = None


class TextPart(Body, frozen=True, kw_only=True, tag="text", tag_field="type"):
    text: Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)]


class ImagePart(Body, frozen=True, kw_only=True, tag="image_url", tag_field="type"):
    image_url: ImageUrl


ContentPart = TextPart | ImagePart


FunctionName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]


class FunctionDefinition(Body, frozen=True, kw_only=True):
    """A function the model may call: its name, what it does, and a JSON schema of its arguments."""

    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(Body, frozen=True, kw_only=True):
    """One of `tools`: only function tools exist in the chat API."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(Body, frozen=True, kw_only=True):
    name: FunctionName


class NamedToolChoice(Body, frozen=True, kw_only=True):
    """`tool_choice` naming the function the model must call."""

    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(Body, frozen=True, kw_only=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    arguments: Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)] = ""


class ToolCallIn(Body, frozen=True, kw_only=True):
    """A call an earlier assistant message made (`messages[].tool_calls`), as sent back by the client."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Body, frozen=True, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)] | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant message's calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(SamplingFields, frozen=True, kw_only=True):
    """`POST /v1/chat/completions`."""

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: Tokens | None = None
    max_completion_tokens: Tokens | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, else "none" (OpenAI's)


# ---------------------------------------------------------------------- responses
class Reply(msgspec.Struct, frozen=True, kw_only=True):
    """Base of response bodies (written, never read by the node)."""


class PromptTokensDetails(Reply, frozen=True, kw_only=True):
    cached_tokens: int  # prompt tokens whose KV came from a prefix cache


class Usage(Reply, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(Reply, frozen=True, kw_only=True):
    """A completion's log-probabilities, one entry per token of its `text` (prompt tokens first with
    `echo`; the first prompt token's logprob and alternatives are null). `text_offset`: where each token's
    text starts in `text`."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Reply, frozen=True, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class Completion(Reply, frozen=True, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(Reply, frozen=True, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(Reply, frozen=True, kw_only=True):
    """One generated token: its text, log-probability, UTF-8 bytes and the most likely alternatives."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Reply, frozen=True, kw_only=True):
    content: list[ChatTokenLogprob] | None


class FunctionCall(Reply, frozen=True, kw_only=True):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(Reply, frozen=True, kw_only=True):
    """A call the model made, parsed from its text (`engine.http.tools`)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(Reply, frozen=True, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None: the reply is tool calls only
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)


class ChatChoice(Reply, frozen=True, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class ChatCompletion(Reply, frozen=True, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunction(Reply, frozen=True, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(Reply, frozen=True, kw_only=True, omit_defaults=True):
    """A stream's piece of a tool call: the first for a call has its `id`, `type` and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class Delta(Reply, frozen=True, kw_only=True, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(Reply, frozen=True, kw_only=True):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionChunk(Reply, frozen=True, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(Reply, frozen=True, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "zigzag"
    max_model_len: int


class ModelList(Reply, frozen=True, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(Body, frozen=True, kw_only=True):
    """`POST /tokenize`, as vLLM takes it: a `prompt`, or chat `messages` rendered by the chat template."""

    model: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)] | None = None
    prompt: Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)] | None = None
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1, max_length=MAX_MESSAGES)] | None = None
    tools: list[ToolDefinition] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(Body, frozen=True, kw_only=True):
    """`POST /detokenize`: token ids back to text."""

    model: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)] | None = None
    tokens: Annotated[list[int], msgspec.Meta(max_length=MAX_TEXT_CHARS)]


class TokenizeReply(Reply, frozen=True, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeReply(Reply, frozen=True, kw_only=True):
    prompt: str


class VersionReply(Reply, frozen=True, kw_only=True):
    version: str


class ErrorDetail(Reply, frozen=True, kw_only=True):
    message: str
    type: str
    param: str | None
    code: int


class ErrorBody(Reply, frozen=True, kw_only=True):
    """The error shape vLLM uses: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorDetail
