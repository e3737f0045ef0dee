"""An outcome → a response: whole (`whole`), or as a stream of OpenAI's events (`ResponseEvents`).

The output holds at most one message — all the reply's text outside tool calls, in one `output_text`
part — and one `function_call` item per parsed call (`call_id` `call_...`, `arguments` a JSON object as
text), in the order they began in the text. A reply cut by `max_output_tokens` is `incomplete`
(`incomplete_details.reason` `max_output_tokens`), others `completed`. A stored response's conversation
gains the assistant message it answered (`engine.http.responses_api.store`).

A stream sends `response.created` and `response.in_progress` (the response with no output yet); for the
message `response.output_item.added`, `response.content_part.added`, a `response.output_text.delta`
per piece of text, then `response.output_text.done`, `response.content_part.done` and
`response.output_item.done`; for each call `response.output_item.added`, one
`response.function_call_arguments.delta` with the whole arguments, `response.function_call_arguments.done`
and `response.output_item.done`; last `response.completed` (or `response.incomplete`) with the whole
response. Every event has its `sequence_number` from 0; a failure after the start is one `error` event.
"""

from __future__ import annotations

import uuid
from typing import Literal, final

import msgspec

from engine.control.errors import RequestFailed
from engine.generate.generation import Outcome, Piece
from engine.http.responses_api.store import ResponseStore
from engine.http.responses_api.turn import Turn
from engine.http.tools.calls import call_id
from engine.http.tools.parsers import CallStream, Item, ParsedCall, call_stream
from messages.openai import CalledFunction, ChatMessage, ToolCallIn
from messages.responses_api.replies import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ErrorEvent,
    IncompleteDetails,
    InputTokensDetails,
    OutputFunctionCall,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    ResponseEvent,
    ResponseObject,
    ResponseUsage,
    StreamEvent,
    TextDeltaEvent,
    TextDoneEvent,
)

Stage = Literal["added", "done"]  # the two events of an output item, or of a content part


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@final
class ResponseBuilder:
    """One response's output, item by item as the reply's text comes (see the module docstring)."""

    def __init__(self, turn: Turn, response_id: str, model: str, created: int, store: ResponseStore) -> None:
        self.turn, self.response_id, self.model, self.created = turn, response_id, model, created
        self._store = store
        self._calls: CallStream | None = None if turn.parser is None else call_stream(turn.parser)
        self.output: list[OutputItem] = []
        self.message_index: int | None = None
        self.message_id = new_id("msg")
        self.text = ""

    def feed(self, text: str) -> list[Item]:
        return self._calls.feed(text) if self._calls is not None else ([text] if text else [])

    def finish_items(self) -> list[Item]:
        return self._calls.finish() if self._calls is not None else []

    def add_text(self, text: str) -> bool:
        """Adds `text` to the message; True when this opened it."""
        self.text += text
        if self.message_index is not None:
            return False
        self.message_index = len(self.output)
        self.output.append(self.message("in_progress"))
        return True

    def add_call(self, parsed: ParsedCall) -> tuple[int, OutputFunctionCall]:
        item = OutputFunctionCall(
            id=new_id("fc"),
            status="completed",
            call_id=call_id(),
            name=parsed.name,
            arguments=parsed.arguments,
        )
        self.output.append(item)
        return len(self.output) - 1, item

    def message(self, status: Literal["in_progress", "completed", "incomplete"]) -> OutputMessage:
        content = [] if status == "in_progress" else [OutputText(text=self.text)]
        return OutputMessage(id=self.message_id, status=status, content=content)

    def response(self, outcome: Outcome | None) -> ResponseObject:
        """The response: in progress (`outcome` None), or ended as `outcome` says (and stored)."""
        body = self.turn.body
        started = ResponseObject(
            id=self.response_id,
            created_at=self.created,
            status="in_progress",
            model=self.model,
            output=[],
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            tools=self.turn.tools,
            tool_choice=self.turn.tool_choice,
            parallel_tool_calls=body.parallel_tool_calls is not False,
            previous_response_id=body.previous_response_id,
            store=body.store,
            metadata=body.metadata or {},
        )
        if outcome is None:
            return started
        incomplete = outcome.finish_reason == "length"
        status: Literal["completed", "incomplete"] = "incomplete" if incomplete else "completed"
        if self.message_index is not None:
            self.output[self.message_index] = self.message(status)
        generated = len(outcome.token_ids)
        usage = ResponseUsage(
            input_tokens=outcome.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=outcome.cached_tokens),
            output_tokens=generated,
            total_tokens=outcome.prompt_tokens + generated,
        )
        ended = msgspec.structs.replace(
            started,
            status=status,
            output=list(self.output),
            usage=usage,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if incomplete else None,
        )
        if body.store:
            self._keep(ended)
        return ended

    def _keep(self, response: ResponseObject) -> None:
        calls = [
            ToolCallIn(id=item.call_id, function=CalledFunction(name=item.name, arguments=item.arguments))
            for item in self.output
            if isinstance(item, OutputFunctionCall)
        ]
        answer = ChatMessage(role="assistant", content=self.text or None, tool_calls=calls or None)
        self._store.keep(self.response_id, [*self.turn.conversation, answer], response)


def whole(builder: ResponseBuilder, outcome: Outcome) -> ResponseObject:
    """The whole response to a request that did not stream."""
    for item in [*builder.feed(outcome.text), *builder.finish_items()]:
        if isinstance(item, str):
            builder.add_text(item)
        else:
            builder.add_call(item)
    return builder.response(outcome)


@final
class ResponseEvents:
    """The SSE events of one streamed response (see the module docstring)."""

    def __init__(self, builder: ResponseBuilder) -> None:
        self._builder = builder
        self._sequence = 0

    def _event(self, event: StreamEvent) -> bytes:
        self._sequence += 1
        return b"event: " + event.type.encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"

    @property
    def _next(self) -> int:
        return self._sequence

    def start(self) -> bytes:
        response = self._builder.response(None)
        created = self._event(
            ResponseEvent(type="response.created", sequence_number=self._next, response=response)
        )
        return created + self._event(
            ResponseEvent(type="response.in_progress", sequence_number=self._next, response=response)
        )

    def piece(self, piece: Piece) -> bytes:
        return self._items(self._builder.feed(piece.text))

    def _items(self, items: list[Item]) -> bytes:
        out = b""
        builder = self._builder
        for item in items:
            if isinstance(item, str):
                if builder.add_text(item):
                    out += self._message_opened()
                assert builder.message_index is not None
                out += self._event(
                    TextDeltaEvent(
                        sequence_number=self._next,
                        item_id=builder.message_id,
                        output_index=builder.message_index,
                        content_index=0,
                        delta=item,
                    )
                )
                continue
            index, call = builder.add_call(item)
            out += self._output_item(
                "added", index, msgspec.structs.replace(call, status="in_progress", arguments="")
            )
            out += self._event(
                ArgumentsDeltaEvent(
                    sequence_number=self._next, item_id=call.id, output_index=index, delta=call.arguments
                )
            )
            out += self._event(
                ArgumentsDoneEvent(
                    sequence_number=self._next,
                    item_id=call.id,
                    output_index=index,
                    name=call.name,
                    arguments=call.arguments,
                )
            )
            out += self._output_item("done", index, call)
        return out

    def _message_opened(self) -> bytes:
        builder = self._builder
        assert builder.message_index is not None
        added = self._output_item("added", builder.message_index, builder.message("in_progress"))
        return added + self._content_part("added", builder.message_index, "")

    def finish(self, outcome: Outcome) -> bytes:
        builder = self._builder
        out = self._items(builder.finish_items())
        response = builder.response(outcome)
        if builder.message_index is not None:
            index, item_id = builder.message_index, builder.message_id
            message = response.output[index]
            out += self._event(
                TextDoneEvent(
                    sequence_number=self._next,
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    text=builder.text,
                )
            )
            out += self._content_part("done", index, builder.text)
            out += self._output_item("done", index, message)
        kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
        return out + self._event(ResponseEvent(type=kind, sequence_number=self._next, response=response))

    def _output_item(self, stage: Stage, index: int, item: OutputItem) -> bytes:
        """`response.output_item.added` or `.done`: output item `index` as it is at that stage."""
        kind: Literal["response.output_item.added", "response.output_item.done"] = (
            "response.output_item.added" if stage == "added" else "response.output_item.done"
        )
        return self._event(
            OutputItemEvent(type=kind, sequence_number=self._next, output_index=index, item=item)
        )

    def _content_part(self, stage: Stage, index: int, text: str) -> bytes:
        """`response.content_part.added` or `.done`: the message's one text part (output item `index`),
        holding `text`."""
        kind: Literal["response.content_part.added", "response.content_part.done"] = (
            "response.content_part.added" if stage == "added" else "response.content_part.done"
        )
        return self._event(
            ContentPartEvent(
                type=kind,
                sequence_number=self._next,
                item_id=self._builder.message_id,
                output_index=index,
                content_index=0,
                part=OutputText(text=text),
            )
        )

    def error(self, exc: RequestFailed) -> bytes:
        return self._event(ErrorEvent(sequence_number=self._next, code=exc.code, message=exc.message))

    def done(self) -> bytes:
        return b""  # the Responses API ends its stream with the last event, no `[DONE]`
