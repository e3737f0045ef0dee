"""The OpenAI-compatible HTTP API of a node (docs/http-api.md), as a Starlette app on the node's Trio loop.

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `POST /v1/responses` and
`GET /v1/responses/{id}` (OpenAI's Responses API, run as a chat completion: `engine.http.responses_api`),
`GET /v1/models`, `GET /health`,
`GET /metrics`, and vLLM's `POST /tokenize`, `POST /detokenize`, `GET /version` (`engine.http.tokens`);
any other path answers OpenAI's JSON error with 404. Requests go through the same `Generation` as the control socket's `generate`, so they
share admission, routing, logging and token identity.

A body's choices (`n`, a list of prompts) are one generation each, relayed by `engine.http.choices`; a
streamed reply's body is written by `engine.http.sse`.

Cancellation: a client that disconnects cancels its requests — for a stream, Starlette cancels the body
iterator; otherwise `_until_disconnected` does — and `Choices.close` (in `finally`, no await) frees
their blocks. Errors have vLLM's shape with an HTTP status (`engine.http.errors`); an error after a stream
has started is one SSE `error` event, then `data: [DONE]`.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator
from typing import Final, assert_never, final

import msgspec
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine.control.errors import RequestFailed
from engine.core import NodeCore
from engine.generate.generation import Generation, Outcome
from engine.http.access import Scope, note_generation
from engine.http.chat import renderer
from engine.http.choices import ChoiceEnded, ChoiceEvent, ChoiceFailed, ChoicePiece, Choices
from engine.http.errors import error_response, failed_response, validation_response
from engine.http.logprobs import token_text
from engine.http.metrics import CONTENT_TYPE, NodeMetrics
from engine.http.requests import BadBody, chat_request, completion_requests, prompt_choices
from engine.http.requests import prompts as prompts_of
from engine.http.responses import (
    SseStream,
    chat_choice,
    chat_completion,
    choices_usage,
    completion,
    completion_choice,
)
from engine.http.responses_api.output import ResponseBuilder, ResponseEvents, new_id, whole
from engine.http.responses_api.store import ResponseStore
from engine.http.responses_api.turn import Turn, UnknownResponse, turn
from engine.http.sse import choice_events, response_events
from engine.http.streaming import ClosingStreamingResponse
from engine.http.tokens import TokenRoutes, not_found
from engine.http.tools.choice import forced_calls, tool_parser
from engine.http.tools.parsers import ParserName, Reading
from messages.control import GenerateRequest
from messages.openai import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, Reply
from messages.responses_api.requests import ResponsesRequest
from replicas.ports import EventSink
from replicas.states import ReplicaState

JSON = "application/json"
MAX_BODY_BYTES = 256 * 1024 * 1024
CHOICE_EVENTS: Final = 64  # events of a body's choices waiting for the client


@final
class HttpApi:
    """The routes of one node (its `core`); `app` is the ASGI application hypercorn serves. Each request
    logs how it ended through its `Generation`, as on the control socket."""

    def __init__(
        self,
        core: NodeCore,
        metrics: NodeMetrics,
        *,
        api_key: str | None,
        tool_call_parser: ParserName | None = None,
    ) -> None:
        self.node = core
        self._log: EventSink = core.log
        self.metrics = metrics
        self.api_key = api_key
        self.tool_call_parser = tool_call_parser
        self.stored = ResponseStore()
        self.created = int(time.time())
        self._connections = itertools.count(1)
        self._render = renderer(core.served.chat_template, core.served.name)
        self._token_text = token_text(core.host.tokenizer)
        tokens = TokenRoutes(core.served, core.host.tokenizer, self._render)
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/responses", self.responses, methods=["POST"]),
                Route("/v1/responses/{response_id}", self.stored_response, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/tokenize", tokens.tokenize, methods=["POST"]),
                Route("/detokenize", tokens.detokenize, methods=["POST"]),
                Route("/version", tokens.version, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.prometheus, methods=["GET"]),
            ],
            exception_handlers={404: not_found, 405: not_found},
        )

    @property
    def model_name(self) -> str:
        """The name replies carry (`--served-model-name`'s first, else the model's)."""
        return self.node.served.name

    # ------------------------------------------------------------------ routes
    async def models(self, request: Request) -> Response:
        if (refused := self._refuse_key(request)) is not None:
            return refused
        served = self.node.served
        cards = [
            ModelCard(id=name, created=self.created, max_model_len=served.context) for name in served.names
        ]
        return Response(msgspec.json.encode(ModelList(data=cards)), media_type=JSON)

    async def health(self, request: Request) -> Response:
        states = {replica.state for replica in self.node.directory.local()}
        ready = ReplicaState.PREFILL in states and ReplicaState.DECODE in states
        if not ready or not self.node.router.accepting:
            why = (
                "shutting down"
                if not self.node.router.accepting
                else "no prefill and decode replica serve yet"
            )
            return error_response(503, why, None)
        return Response(b"", status_code=200)

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, CompletionRequest)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, ChatCompletionRequest)

    async def responses(self, request: Request) -> Response:
        return await self._serve(request, ResponsesRequest)

    async def stored_response(self, request: Request) -> Response:
        if (refused := self._refuse_key(request)) is not None:
            return refused
        response_id = request.path_params["response_id"]
        stored = self.stored.response(response_id)
        if stored is None:
            return error_response(404, f"Response with id {response_id!r} not found", "response_id")
        return Response(msgspec.json.encode(stored), media_type=JSON)

    # ------------------------------------------------------------------ serving
    async def _serve(
        self,
        request: Request,
        kind: type[CompletionRequest] | type[ChatCompletionRequest] | type[ResponsesRequest],
    ) -> Response:
        if (refused := self._refuse_key(request)) is not None:
            return refused
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            self.metrics.refused("bad_request")
            return error_response(413, f"the body is {len(raw)} bytes, over the {MAX_BODY_BYTES} limit", None)
        try:
            body = msgspec.json.decode(raw, type=kind)
        except msgspec.ValidationError as exc:
            self.metrics.refused("bad_request")
            return validation_response(exc)
        except msgspec.DecodeError as exc:
            self.metrics.refused("bad_request")
            return error_response(400, f"the body is not valid JSON: {exc}", None)
        names = self.node.served.names
        if body.model is not None and body.model not in names:
            self.metrics.refused("not_found")
            served = " or ".join(repr(name) for name in names)
            return error_response(
                404, f"the model {body.model!r} does not exist; this node serves {served}", "model"
            )
        asked: Turn | None = None
        parser: Reading | None = None
        try:
            if isinstance(body, ResponsesRequest):
                asked = turn(body, self.stored, self.tool_call_parser)
                parser = asked.parser
            elif isinstance(body, ChatCompletionRequest):
                parser = tool_parser(body.tools, body.tool_choice, self.tool_call_parser)
            generated = asked.chat if asked is not None else body
            assert not isinstance(generated, ResponsesRequest)
            prompts = self._generate_requests(generated)
            if isinstance(generated, ChatCompletionRequest):
                prompts = forced_calls(prompts, generated.tools, generated.tool_choice)
        except BadBody as exc:
            self.metrics.refused("bad_request")
            return error_response(400, exc.message, exc.param)
        except UnknownResponse as exc:
            self.metrics.refused("not_found")
            return error_response(404, exc.message, "previous_response_id")
        connection = f"http-{next(self._connections)}"
        choices = Choices(
            prompt_choices(prompts, generated.n),
            lambda generate: self._start(generate, connection, request.scope),
        )
        try:
            choices.open()
        except RequestFailed as exc:
            choices.close()
            return failed_response(exc)
        request_id = f"{'chatcmpl' if kind is ChatCompletionRequest else 'cmpl'}-{uuid.uuid4().hex}"
        echoes = self._echoes(body) if isinstance(body, CompletionRequest) and body.echo else None
        built = None
        if asked is not None:
            built = ResponseBuilder(asked, new_id("resp"), self.model_name, int(time.time()), self.stored)
        send, receive = trio.open_memory_channel[ChoiceEvent](CHOICE_EVENTS)
        if body.stream:
            events: AsyncIterator[bytes]
            if built is not None:
                events = response_events(choices, receive, ResponseEvents(built))
            else:
                assert not isinstance(body, ResponsesRequest)
                include_usage = body.stream_options is not None and body.stream_options.include_usage
                encoder = SseStream(
                    request_id,
                    self.model_name,
                    int(time.time()),
                    chat=isinstance(body, ChatCompletionRequest),
                    include_usage=include_usage,
                    text=self._token_text,
                    tools=parser,
                )
                events = choice_events(choices, receive, encoder, echoes)
            return ClosingStreamingResponse(
                events,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
                beside=lambda: choices.run(send),
            )
        outcomes: dict[int, Outcome] = {}
        failure: RequestFailed | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._until_disconnected, request, nursery.cancel_scope)
                nursery.start_soon(choices.run, send)
                async for event in receive:  # not closed: the cancel below ends the choices' relays
                    match event:
                        case ChoicePiece():
                            pass
                        case ChoiceEnded(index=index, outcome=outcome):
                            outcomes[index] = outcome
                        case ChoiceFailed(error=error):
                            failure = error
                            break
                        case _:
                            assert_never(event)
                nursery.cancel_scope.cancel()
        finally:
            choices.close()
        if failure is not None:
            return failed_response(failure)
        if len(outcomes) < choices.count:  # the client went away: nobody reads this
            return Response(b"", status_code=499)
        created = int(time.time())
        ordered = [outcomes[index] for index in range(choices.count)]
        total = choices_usage(ordered, choices.n)
        if built is not None:
            reply: Reply = whole(built, ordered[0])
        elif isinstance(body, ChatCompletionRequest):
            chat = [
                chat_choice(index, outcome, self._token_text, parser) for index, outcome in enumerate(ordered)
            ]
            reply = chat_completion(request_id, self.model_name, created, chat, total)
        else:
            texts = [
                completion_choice(
                    index,
                    outcome,
                    self._token_text,
                    None if echoes is None else echoes[index // choices.n],
                    ordered[index - index % choices.n],
                )
                for index, outcome in enumerate(ordered)
            ]
            reply = completion(request_id, self.model_name, created, texts, total)
        return Response(msgspec.json.encode(reply), media_type=JSON)

    def _start(self, generate: GenerateRequest, connection: str, scope: Scope) -> Generation:
        """Admit one choice's request (`RequestFailed` when refused); the access line of the HTTP request
        in `scope` counts it."""
        generation = Generation.start(
            self.node.host,
            self.node.settings,
            self.node.router,
            self._log,
            generate,
            self.node.served,
            connection=connection,
            token_gap=self.metrics.token_gap,
        )
        generation.cancel_reason = lambda: "client_disconnected" if self.node.router.accepting else "shutdown"
        note_generation(scope, generation.serving)
        return generation

    def _echoes(self, body: CompletionRequest) -> list[str]:
        """Each prompt's text, as `echo` puts it before its completions: as sent, or its ids decoded."""
        tokenizer = self.node.host.tokenizer
        return [
            prompt if isinstance(prompt, str) else tokenizer.decode(prompt) if tokenizer is not None else ""
            for prompt in prompts_of(body)
        ]

    def _generate_requests(self, body: CompletionRequest | ChatCompletionRequest) -> list[GenerateRequest]:
        """One request per prompt (choice 0's)."""
        vocab_size = self.node.host.config.vocab_size
        if isinstance(body, CompletionRequest):
            return completion_requests(body, vocab_size)
        return [chat_request(body, self._render, vocab_size)]

    @staticmethod
    async def _until_disconnected(request: Request, scope: trio.CancelScope) -> None:
        """Cancel `scope` when the client disconnects (the body was read: only `http.disconnect` comes)."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                scope.cancel()
                return

    def _refuse_key(self, request: Request) -> Response | None:
        if self.api_key is None:
            return None
        if request.headers.get("authorization", "") != f"Bearer {self.api_key}":
            return error_response(401, "missing or wrong API key (send `Authorization: Bearer <key>`)", None)
        return None
