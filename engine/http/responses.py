"""Response bodies: whole completions, and the SSE chunks of a stream (`data: {json}\n\n` each).

A chat stream starts with a chunk whose delta holds the role, then one chunk per piece of text, then a
chunk with the finish reason; with `stream_options.include_usage`, a last chunk with no choices carries
the usage (and every chunk has `"usage": null`), as OpenAI's streams do. A completion stream is the same
without the role chunk. The finish reason `cancelled` is reported as vLLM does: `abort`. Where the request
asked for log-probabilities, each choice (and each stream chunk) carries those of its tokens
(`engine.http.logprobs`); `echo` puts the prompt, and its tokens' log-probabilities, first.

With a tool-call parser (`engine.http.tools`), a chat reply's calls come back as `message.tool_calls`
and the finish reason `tool_calls`; a stream holds back text that may be a call until it is known
(from `<tool_call>` to `</tool_call>`) and sends each call whole, in one `delta.tool_calls` chunk — each
choice with a parser of its own.

Several choices (`n`, a list of prompts): a whole response lists them by index; a stream's chunks each
carry one choice's index (a chat stream opens every choice with its role), each choice ends with its own
finish chunk, and the usage chunk comes once, after the last. Usage counts each prompt once and every
choice's generated tokens, as OpenAI and vLLM do.
"""

from __future__ import annotations

from typing import final

import msgspec

from engine.generate.generation import Outcome, Piece
from engine.http.logprobs import CompletionScores, TokenText, chat_logprobs
from engine.http.tools.calls import ToolDeltas, assistant_message
from engine.http.tools.calls import finish_reason as tools_finish_reason
from engine.http.tools.parsers import Reading
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


def usage(firsts: list[Outcome], others: list[Outcome]) -> Usage:
    """`firsts`: each prompt's choice 0 (its prompt and cached tokens counted); `others`: the other
    choices (only their generated tokens counted)."""
    prompt = sum(outcome.prompt_tokens for outcome in firsts)
    generated = sum(len(outcome.token_ids) for outcome in [*firsts, *others])
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=generated,
        total_tokens=prompt + generated,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(o.cached_tokens for o in firsts)),
    )


def choices_usage(ordered: list[Outcome], n: int) -> Usage:
    """The usage of a body's choices, in index order (`n` per prompt): each prompt once (its choice 0),
    every choice's tokens."""
    return usage(ordered[::n], [outcome for index, outcome in enumerate(ordered) if index % n])


def completion(
    request_id: str, model: str, created: int, choices: list[CompletionChoice], total: Usage
) -> Completion:
    return Completion(id=request_id, created=created, model=model, choices=choices, usage=total)


def completion_choice(
    index: int, outcome: Outcome, text: TokenText, echo: str | None = None, prompt: Outcome | None = None
) -> CompletionChoice:
    """One choice of a whole completion; `echo`: the prompt's text, put before the generated text, with
    the prompt tokens' log-probabilities of `prompt` (the outcome that scored them: its prompt's choice 0;
    default `outcome`)."""
    logprobs = None
    scoring = outcome if prompt is None else prompt
    if outcome.logprobs is not None:
        scores = CompletionScores(text)
        scored: list[TokenLogprobs | None] = list(outcome.logprobs)
        token_ids = list(outcome.token_ids)
        if echo is not None and scoring.prompt_logprobs is not None and scoring.prompt_ids is not None:
            scored = [*scoring.prompt_logprobs, *scored]
            token_ids = [*scoring.prompt_ids, *token_ids]
        logprobs = scores.scores(scored, token_ids)
    return CompletionChoice(
        index=index,
        text=(echo or "") + outcome.text,
        logprobs=logprobs,
        finish_reason=finish_reason(outcome),
    )


def chat_completion(
    request_id: str, model: str, created: int, choices: list[ChatChoice], total: Usage
) -> ChatCompletion:
    return ChatCompletion(id=request_id, created=created, model=model, choices=choices, usage=total)


def chat_choice(index: int, outcome: Outcome, text: TokenText, tools: Reading | None = None) -> ChatChoice:
    """One choice of a whole chat completion; with `tools` (a parser), its text parsed for tool calls."""
    message = (
        AssistantMessage(content=outcome.text) if tools is None else assistant_message(outcome.text, tools)
    )
    return ChatChoice(
        index=index,
        message=message,
        logprobs=None if outcome.logprobs is None else chat_logprobs(outcome.logprobs, text),
        finish_reason=tools_finish_reason(finish_reason(outcome), message),
    )


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
        tools: Reading | None = None,
    ) -> None:
        self.request_id, self.model, self.created = request_id, model, created
        self.chat, self.include_usage = chat, include_usage
        self._token_text = text
        self._scores = CompletionScores(text)
        self._tool_parser = tools
        self._tools: dict[int, ToolDeltas] = {}  # each choice's parser, made at its first piece

    def _parser(self, index: int) -> ToolDeltas | None:
        if self._tool_parser is None:
            return None
        if index not in self._tools:
            self._tools[index] = ToolDeltas(self._tool_parser)
        return self._tools[index]

    def _chunk(
        self,
        index: int,
        text: str | None,
        reason: str | None,
        *,
        role: bool = False,
        piece: Piece | None = None,
    ) -> bytes:
        """One chunk with choice `index`: `text` (None: no content), `reason`, and the log-probabilities
        of `piece`'s tokens where it has them."""
        scored = None if piece is None else piece.logprobs
        if self.chat:
            delta = Delta(role="assistant" if role else None, content=text)
            logprobs = None if scored is None else chat_logprobs(scored, self._token_text)
            choices = [ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=reason)]
            return event(
                ChatCompletionChunk(
                    id=self.request_id, created=self.created, model=self.model, choices=choices
                )
            )
        completion_logprobs = None
        if scored is not None and piece is not None:
            completion_logprobs = self._scores.scores(list(scored), piece.token_ids)
        choice = CompletionChoice(
            index=index, text=text or "", logprobs=completion_logprobs, finish_reason=reason
        )
        return event(Completion(id=self.request_id, created=self.created, model=self.model, choices=[choice]))

    def start(self, choices: int) -> bytes:
        """A chat stream opens each choice with the role; a completion stream has no opening chunk."""
        return (
            b"".join(self._chunk(index, "", None, role=True) for index in range(choices))
            if self.chat
            else b""
        )

    def piece(self, index: int, piece: Piece) -> bytes:
        tools = self._parser(index)
        if tools is None:
            return self._chunk(index, piece.text, None, piece=piece)
        deltas = tools.feed(piece.text)
        if not deltas and piece.logprobs:  # the text is held back; its tokens' scores are not
            deltas = [Delta()]
        return b"".join(
            self._delta(index, delta, piece if position == 0 else None)
            for position, delta in enumerate(deltas)
        )

    def _delta(self, index: int, delta: Delta, piece: Piece | None, reason: str | None = None) -> bytes:
        """A chat chunk of choice `index` with `delta`, the log-probabilities of `piece`'s tokens, and
        `reason`."""
        scored = None if piece is None else piece.logprobs
        logprobs = None if scored is None else chat_logprobs(scored, self._token_text)
        choices = [ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=reason)]
        return event(
            ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=choices)
        )

    def echo(
        self, index: int, text: str, prompt_ids: list[int], scored: list[TokenLogprobs | None] | None
    ) -> bytes:
        """A completion choice's first chunk with `echo`: the prompt's text, and its tokens' scores."""
        logprobs = None if scored is None else self._scores.scores(scored, prompt_ids)
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=None)
        return event(Completion(id=self.request_id, created=self.created, model=self.model, choices=[choice]))

    def finish(self, index: int, outcome: Outcome) -> bytes:
        """Choice `index`'s last chunk: its finish reason (after the calls its parser held back)."""
        tools = self._parser(index)
        if tools is None:
            return self._chunk(index, None, finish_reason(outcome))
        held = b"".join(self._delta(index, delta, None) for delta in tools.finish())
        reason = "tool_calls" if tools.calls else finish_reason(outcome)
        return held + self._delta(index, Delta(), None, reason)

    def close(self, total: Usage) -> bytes:
        """After every choice finished: the usage chunk, when the request asked for it."""
        if not self.include_usage:
            return b""
        kind = ChatCompletionChunk if self.chat else Completion
        return event(
            kind(id=self.request_id, created=self.created, model=self.model, choices=[], usage=total)
        )
