"""Response bodies: whole completions, and the SSE chunks of a stream (`data: {json}\n\n` each).

A chat stream starts with a chunk whose delta holds the role, then one chunk per piece of text, then a
chunk with the finish reason; with `stream_options.include_usage`, a last chunk with no choices carries
the usage (and every chunk has `"usage": null`), as OpenAI's streams do. A completion stream is the same
without the role chunk. The finish reason `cancelled` is reported as vLLM does: `abort`. Where the request
asked for log-probabilities, each choice (and each stream chunk) carries those of its tokens
(`engine.http.logprobs`); `echo` puts the prompt, and its tokens' log-probabilities, first.

With a tool-call parser (`engine.http.tools`), a chat reply's calls come back as `message.tool_calls`
and the finish reason `tool_calls`; a stream holds back text that may be a call until it is known
(from `<tool_call>` to `</tool_call>`) and sends each call whole, in one `delta.tool_calls` chunk.
"""

from __future__ import annotations

from typing import final

import msgspec

from engine.control.errors import RequestFailed
from engine.generate.generation import Outcome, Piece
from engine.http.errors import sse_error
from engine.http.logprobs import CompletionScores, TokenText, chat_logprobs
from engine.http.tools.calls import ToolDeltas, assistant_message
from engine.http.tools.calls import finish_reason as tools_finish_reason
from engine.http.tools.parsers import ParserName
from messages.openai import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    Delta,
    PromptTokensDetails,
    Reply,
    Usage,
)
from replicas.model import TokenLogprobs


def finish_reason(outcome: Outcome) -> str:
    return "abort" if outcome.finish_reason == "cancelled" else outcome.finish_reason


def usage(outcome: Outcome) -> Usage:
    generated = len(outcome.token_ids)
    return Usage(
        prompt_tokens=outcome.prompt_tokens,
        completion_tokens=generated,
        total_tokens=outcome.prompt_tokens + generated,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=outcome.cached_tokens),
    )


def completion(
    request_id: str, model: str, created: int, outcome: Outcome, text: TokenText, echo: str | None = None
) -> Completion:
    """The whole completion; `echo`: the prompt's text, put before the generated text."""
    logprobs = None
    if outcome.logprobs is not None:
        scores = CompletionScores(text)
        scored: list[TokenLogprobs | None] = list(outcome.logprobs)
        token_ids = list(outcome.token_ids)
        if echo is not None and outcome.prompt_logprobs is not None and outcome.prompt_ids is not None:
            scored = [*outcome.prompt_logprobs, *scored]
            token_ids = [*outcome.prompt_ids, *token_ids]
        logprobs = scores.scores(scored, token_ids)
    choice = CompletionChoice(
        index=0,
        text=(echo or "") + outcome.text,
        logprobs=logprobs,
        finish_reason=finish_reason(outcome),
    )
    return Completion(id=request_id, created=created, model=model, choices=[choice], usage=usage(outcome))


def chat_completion(
    request_id: str,
    model: str,
    created: int,
    outcome: Outcome,
    text: TokenText,
    tools: ParserName | None = None,
) -> ChatCompletion:
    """The whole chat completion; with `tools` (a parser), its text parsed for tool calls."""
    message = (
        AssistantMessage(content=outcome.text) if tools is None else assistant_message(outcome.text, tools)
    )
    choice = ChatChoice(
        index=0,
        message=message,
        logprobs=None if outcome.logprobs is None else chat_logprobs(outcome.logprobs, text),
        finish_reason=tools_finish_reason(finish_reason(outcome), message),
    )
    return ChatCompletion(id=request_id, created=created, model=model, choices=[choice], usage=usage(outcome))


def event(body: Reply) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


@final
class SseStream:
    """The SSE chunks of one streamed completion (`chat` false) or chat completion (`chat` true)."""

    def __init__(
        self,
        request_id: str,
        model: str,
        created: int,
        *,
        chat: bool,
        include_usage: bool,
        text: TokenText,
        tools: ParserName | None = None,
    ) -> None:
        self.request_id, self.model, self.created = request_id, model, created
        self.chat, self.include_usage = chat, include_usage
        self._token_text = text
        self._scores = CompletionScores(text)
        self._tools = None if tools is None else ToolDeltas(tools)

    def _chunk(
        self, text: str | None, reason: str | None, *, role: bool = False, piece: Piece | None = None
    ) -> bytes:
        """One chunk with one choice: `text` (None: no content), `reason`, and the log-probabilities of
        `piece`'s tokens where it has them."""
        scored = None if piece is None else piece.logprobs
        if self.chat:
            delta = Delta(role="assistant" if role else None, content=text)
            logprobs = None if scored is None else chat_logprobs(scored, self._token_text)
            choices = [ChatChunkChoice(index=0, delta=delta, logprobs=logprobs, finish_reason=reason)]
            return event(
                ChatCompletionChunk(
                    id=self.request_id, created=self.created, model=self.model, choices=choices
                )
            )
        completion_logprobs = None
        if scored is not None and piece is not None:
            completion_logprobs = self._scores.scores(list(scored), piece.token_ids)
        choice = CompletionChoice(
            index=0, text=text or "", logprobs=completion_logprobs, finish_reason=reason
        )
        return event(Completion(id=self.request_id, created=self.created, model=self.model, choices=[choice]))

    def start(self) -> bytes:
        """A chat stream opens with the role; a completion stream has no opening chunk."""
        return self._chunk("", None, role=True) if self.chat else b""

    def piece(self, piece: Piece) -> bytes:
        if self._tools is None:
            return self._chunk(piece.text, None, piece=piece)
        deltas = self._tools.feed(piece.text)
        if not deltas and piece.logprobs:  # the text is held back; its tokens' scores are not
            deltas = [Delta()]
        return b"".join(
            self._delta(delta, piece if index == 0 else None) for index, delta in enumerate(deltas)
        )

    def _delta(self, delta: Delta, piece: Piece | None, reason: str | None = None) -> bytes:
        """A chat chunk with `delta`, the log-probabilities of `piece`'s tokens, and `reason`."""
        scored = None if piece is None else piece.logprobs
        logprobs = None if scored is None else chat_logprobs(scored, self._token_text)
        choices = [ChatChunkChoice(index=0, delta=delta, logprobs=logprobs, finish_reason=reason)]
        return event(
            ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=choices)
        )

    def echo(self, text: str, prompt_ids: list[int], scored: list[TokenLogprobs | None] | None) -> bytes:
        """A completion stream's first chunk with `echo`: the prompt's text, and its tokens' scores."""
        logprobs = None if scored is None else self._scores.scores(scored, prompt_ids)
        choice = CompletionChoice(index=0, text=text, logprobs=logprobs, finish_reason=None)
        return event(Completion(id=self.request_id, created=self.created, model=self.model, choices=[choice]))

    def finish(self, outcome: Outcome) -> bytes:
        if self._tools is None:
            last = self._chunk(None, finish_reason(outcome))
        else:
            held = b"".join(self._delta(delta, None) for delta in self._tools.finish())
            reason = "tool_calls" if self._tools.calls else finish_reason(outcome)
            last = held + self._delta(Delta(), None, reason)
        if not self.include_usage:
            return last
        kind = ChatCompletionChunk if self.chat else Completion
        body = kind(
            id=self.request_id, created=self.created, model=self.model, choices=[], usage=usage(outcome)
        )
        return last + event(body)

    @staticmethod
    def error(exc: RequestFailed) -> bytes:
        return sse_error(exc)

    @staticmethod
    def done() -> bytes:
        return b"data: [DONE]\n\n"
