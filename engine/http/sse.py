"""The SSE bodies of streamed replies: a body's choice events (`engine.http.choices`) as the bytes the
client reads.

`choice_events` writes `/v1/completions` and `/v1/chat/completions` (chunks by `SseStream`),
`response_events` writes `/v1/responses` (OpenAI's named events by `ResponseEvents`). Both end with
`data: [DONE]`; a choice that fails after the stream started is one SSE `error` event before it.

Cancellation: Starlette cancels a body when its client disconnects; `Choices.close` (in `finally`, no
await) then cancels the choices still running. `receive` is left open: the stream's end cancels the
choices' relays.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import assert_never

import trio

from engine.control.errors import RequestFailed
from engine.generate.generation import Generation, Outcome
from engine.http.choices import ChoiceEnded, ChoiceEvent, ChoiceFailed, ChoicePiece, Choices
from engine.http.errors import sse_error
from engine.http.responses import SseStream, choices_usage
from engine.http.responses_api.output import ResponseEvents


async def choice_events(
    choices: Choices,
    receive: trio.MemoryReceiveChannel[ChoiceEvent],
    encoder: SseStream,
    echoes: list[str] | None,
) -> AsyncIterator[bytes]:
    """The SSE body: each choice's chunks as they come, its finish chunk, then the usage once all
    ended. With `echoes` (a completion's prompt texts) a choice's prompt chunk comes first, once its
    prefill ended."""
    echoed: set[int] = set()

    def echo(index: int, generation: Generation) -> bytes:
        if echoes is None or index in echoed:
            return b""
        echoed.add(index)
        # The prompt's scores are its choice 0's (it alone asked; it ran the prompt before the others
        # started).
        first = choices.generations[index - index % choices.n]
        scored = None if first.serving.prompt_logprobs is None else first.prompt_logprobs()
        serving = generation.serving
        prompt_ids = list(serving.token_ids or serving.prompt_ids)
        return encoder.echo(index, echoes[index // choices.n], prompt_ids, scored)

    outcomes: dict[int, Outcome] = {}
    try:
        if first := encoder.start(choices.count):
            yield first
        try:
            async for event in receive:
                match event:
                    case ChoicePiece(index=index, generation=generation, piece=piece):
                        if opening := echo(index, generation):
                            yield opening
                        if piece.text or piece.logprobs:
                            yield encoder.piece(index, piece)
                    case ChoiceEnded(index=index, generation=generation, outcome=outcome):
                        if opening := echo(index, generation):
                            yield opening
                        outcomes[index] = outcome
                        yield encoder.finish(index, outcome)
                    case ChoiceFailed(error=error):
                        raise error
                    case _:
                        assert_never(event)
        except RequestFailed as exc:
            yield sse_error(exc)
        else:
            ordered = [outcomes[index] for index in range(choices.count)]
            if closing := encoder.close(choices_usage(ordered, choices.n)):
                yield closing
        yield b"data: [DONE]\n\n"
    finally:
        choices.close()


async def response_events(
    choices: Choices,
    receive: trio.MemoryReceiveChannel[ChoiceEvent],
    encoder: ResponseEvents,
) -> AsyncIterator[bytes]:
    """The SSE body of a streamed response (`/v1/responses`: one choice), its events as OpenAI names
    them."""
    try:
        yield encoder.start()
        try:
            async for event in receive:
                match event:
                    case ChoicePiece(piece=piece):
                        if piece.text or piece.logprobs:
                            yield encoder.piece(piece)
                    case ChoiceEnded(outcome=outcome):
                        yield encoder.finish(outcome)
                    case ChoiceFailed(error=error):
                        raise error
                    case _:
                        assert_never(event)
        except RequestFailed as exc:
            yield encoder.error(exc)
        yield encoder.done()
    finally:
        choices.close()
