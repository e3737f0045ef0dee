"""One `generate`, admitted and relayed: what the control socket and the HTTP API both serve.

    generation = Generation.start(host, settings, router, log, request, served, connection="http-3")
    # ^ RequestFailed
    try:
        async for piece in generation.pieces():      # Piece(index, token_ids, text) as they come
            ...
        outcome = generation.outcome()               # finish reason, every token, the whole text
    finally:
        generation.close()                           # cancels it when it has not ended (no await)

Log-probabilities, where the request asked for them, come with the tokens they score: each piece's
`logprobs`, the outcome's `logprobs` and `prompt_logprobs`.

Text is decoded incrementally (`TextStream`): no piece ends in half a UTF-8 character, and the pieces'
texts add up to the outcome's text. Stop strings (`StopText`) end the request early: the tokens up to
the one that completed the stop string are kept, the text ends before it, and the finish reason is
`stop`. A failure of the request is raised from `pieces` as `RequestFailed` with its code.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import assert_never, final

import msgspec

from engine.control.errors import RequestFailed
from engine.generate.admission import build_request, new_request_id
from engine.generate.served import ServedModel
from engine.generate.stops import StopText
from engine.router import Router
from messages.control import GenerateRequest
from messages.control_replies import RelayInfo, Timings, TransferSummary
from messages.log.events import RequestArrived, RequestCancelled, RequestFinished
from messages.log.events import RequestFailed as RequestFailedEvent
from replicas.model import TextStream, TokenLogprobs
from replicas.ports import EventSink
from replicas.request import (
    CancelReason,
    FailedUpdate,
    FinishedUpdate,
    FinishReason,
    ServingRequest,
    TokensUpdate,
)
from replicas.settings import ReplicaSettings
from replicas.weights import ModelHost


@final
@dataclass(frozen=True, slots=True)
class Piece:
    """Generated tokens `[index, index + len(token_ids))` and the text they complete (may be empty);
    their `logprobs` when the request asked for them."""

    index: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprobs, ...] | None = None


@final
@dataclass(frozen=True, slots=True)
class Outcome:
    """How a generation ended normally (a failure is raised instead)."""

    request_id: str
    prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    timings: Timings
    transfers: list[TransferSummary]
    relay: RelayInfo | None = None
    prompt_ids: list[int] | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    cached_tokens: int = 0
    cached_from: str | None = None


@final
class Generation:
    """An admitted request and its relay to one client (see the module docstring)."""

    def __init__(
        self,
        serving: ServingRequest,
        request: GenerateRequest,
        router: Router,
        host: ModelHost,
        token_gap: Callable[[float, int], None] | None = None,
    ):
        self.serving = serving
        self.request = request
        self._router = router
        tokenizer = host.tokenizer
        self._tokenizer = tokenizer
        wants_text = request.stream or bool(request.stop)
        self._stream = TextStream(tokenizer) if tokenizer is not None and wants_text else None
        self._stops = StopText(request.stop, min_tokens=request.min_tokens) if request.stop else None
        self._relayed = 0  # tokens relayed so far: the replicas may be ahead of this task
        self._text: list[str] = []
        self._finish: FinishReason | None = None
        # Inter-token latency, observed here for every relay (socket and HTTP): `token_gap(seconds,
        # tokens)` for each batch of tokens after the first, against the previous batch's arrival.
        self._token_gap = token_gap
        self._last_tokens: float | None = None
        # Why the request is cancelled when `close` finds it still running (set by the relaying side).
        self.cancel_reason: Callable[[], CancelReason] | None = None

    @property
    def request_id(self) -> str:
        return self.serving.request_id

    @classmethod
    def start(
        cls,
        host: ModelHost,
        settings: ReplicaSettings,
        router: Router,
        log: EventSink,
        request: GenerateRequest,
        served: ServedModel,
        *,
        connection: str,
        token_gap: Callable[[float, int], None] | None = None,
    ) -> Generation:
        """Admit `request` (a node-chosen id when it has none) and log its arrival — and, when it ends, how
        it ended (`log_end`). Raises `RequestFailed` (with the request id) when it is refused: a refused
        request has still arrived, and failed."""
        request_id = request.request_id or new_request_id()
        if request_id in router.requests:  # before any event: the log of the live one stays its own
            raise RequestFailed("bad_request", f"request_id {request_id!r} is already in use", request_id)
        request = msgspec.structs.replace(request, request_id=request_id)
        log = log.bind(request_id=request_id)

        def arrived(prompt_tokens: int | None, max_tokens: int | None) -> RequestArrived:
            return RequestArrived(
                connection=connection,
                prompt_tokens=prompt_tokens,
                images=len(request.images),
                max_tokens=served.context if max_tokens is None else max_tokens,  # None: up to the context
                stream=request.stream,
            )

        try:
            serving = build_request(request, host, settings, served)
        except RequestFailed as exc:
            log.emit(arrived(None, request.max_tokens))
            log.emit(RequestFailedEvent(code=exc.code, message=exc.message))
            raise RequestFailed(exc.code, exc.message, request_id) from None
        log.emit(arrived(len(serving.prompt_ids), serving.max_tokens))
        serving.on_end.append(functools.partial(log_end, log))
        try:
            router.admit(serving)
        except RequestFailed as exc:
            serving.fail(exc.code, exc.message)
            raise RequestFailed(exc.code, exc.message, request_id) from None
        return cls(serving, request, router, host, token_gap)

    async def pieces(self) -> AsyncIterator[Piece]:
        """The generated tokens as they come, then returns once the request ended normally; raises
        `RequestFailed` when it failed. Cancelling the caller leaves the request running: `close` it."""
        serving = self.serving
        async for update in serving.updates:
            match update:
                case TokensUpdate(token_ids=token_ids):
                    if self._stops is not None and self._stops.stopped:
                        continue  # tokens after the stop string: the replica had not seen the stop yet
                    self._observe_gap(len(token_ids))
                    piece = self._take(token_ids)
                    if serving.ended and self._relayed == len(serving.generated):
                        # The last tokens (the final update is already queued): the text held back
                        # goes with them, so the pieces' texts add up to the outcome's.
                        piece = Piece(piece.index, piece.token_ids, piece.text + self._tail(), piece.logprobs)
                    if piece.token_ids or piece.text:
                        yield piece
                case FinishedUpdate(finish_reason=reason):
                    tail = self._tail()
                    # The held-back text may complete a stop string only now, after the last token.
                    self._finish = "stop" if self._stops is not None and self._stops.stopped else reason
                    if tail:  # the text held back for an unfinished character or a possible stop string
                        yield Piece(self._relayed, (), tail)
                    return
                case FailedUpdate(code=code, message=message):
                    raise RequestFailed(code, message, serving.request_id)
                case _:
                    assert_never(update)

    def outcome(self) -> Outcome:
        """The ended generation (after `pieces` returned)."""
        serving = self.serving
        assert self._finish is not None, "outcome() before pieces() returned"
        if self._stops is not None and self._stops.stopped:
            text = "".join(self._text)
        else:
            text = self._tokenizer.decode(serving.generated) if self._tokenizer is not None else ""
        return Outcome(
            request_id=serving.request_id,
            prompt_tokens=serving.prompt_tokens or len(serving.prompt_ids),
            token_ids=list(serving.generated),
            text=text,
            finish_reason=self._finish,
            timings=serving.timings(),
            transfers=list(serving.transfers),
            relay=serving.relay,
            prompt_ids=list(serving.token_ids or serving.prompt_ids),
            logprobs=None if serving.logprobs is None else self._logprobs(0, len(serving.generated)),
            prompt_logprobs=None if serving.prompt_logprobs is None else self.prompt_logprobs(),
            cached_tokens=serving.cached_tokens,
            cached_from=serving.cached_from if serving.cached_tokens else None,
        )

    def prompt_logprobs(self) -> list[TokenLogprobs | None]:
        """The prompt tokens' log-probabilities (the request asked for them; its prefill ended)."""
        serving = self.serving
        if len(serving.prompt_scores) != serving.prompt_tokens:
            raise RequestFailed(
                "internal",
                f"the prompt's log-probabilities of request {self.request_id} were lost",
                self.request_id,
            )
        return list(serving.prompt_scores)

    def _logprobs(self, start: int, stop: int) -> list[TokenLogprobs]:
        """The generated tokens `[start, stop)`'s log-probabilities (the request asked for them)."""
        scored = list(self.serving.generated_logprobs[start:stop])
        if len(scored) != stop - start:
            raise RequestFailed(
                "internal",
                f"the log-probabilities of tokens [{start}, {stop}) of request {self.request_id} were lost",
                self.request_id,
            )
        return scored

    def close(self) -> None:
        """Cancel the request unless it ended (no await: safe in `finally` of a cancelled task)."""
        serving = self.serving
        if not serving.ended:
            if self.cancel_reason is not None:
                serving.note_cancel_reason(self.cancel_reason())
            self._router.cancel(serving.request_id)

    def _observe_gap(self, tokens: int) -> None:
        now = time.monotonic()
        if self._token_gap is not None and self._last_tokens is not None:
            self._token_gap(now - self._last_tokens, tokens)
        self._last_tokens = now

    # ------------------------------------------------------------------ text
    def _take(self, token_ids: tuple[int, ...]) -> Piece:
        index = self._relayed
        wants = self.serving.logprobs is not None
        if self._stream is None:
            self._relayed += len(token_ids)
            scored = tuple(self._logprobs(index, self._relayed)) if wants else None
            return Piece(index, token_ids, "", scored)
        stops, texts, kept = self._stops, [], []
        for token in token_ids:
            text = self._stream.push((token,))
            kept.append(token)
            if stops is not None:
                text = stops.push(text)
            texts.append(text)
            if stops is not None and stops.stopped:
                self.serving.stop_early(index + len(kept))
                break
        self._relayed += len(kept)
        text = "".join(texts)
        self._text.append(text)
        scored = tuple(self._logprobs(index, self._relayed)) if wants else None
        return Piece(index, tuple(kept), text, scored)

    def _tail(self) -> str:
        """What the detokeniser and the stop strings held back (once: later calls return "")."""
        if self._stream is None:
            return ""
        if self._stops is not None and self._stops.stopped:
            return ""
        tail = self._stream.finish()
        if self._stops is not None:
            tail = self._stops.finish(tail)
        self._text.append(tail)
        return tail


def log_end(log: EventSink, serving: ServingRequest) -> None:
    """Log how `serving` ended (`log`: bound to its request id): failed, cancelled, or finished with its
    counts and timings. Both front doors (the control socket, the HTTP API) log alike through it."""
    update = serving.final_update
    timings = serving.timings()
    if isinstance(update, FailedUpdate):
        log.emit(RequestFailedEvent(code=update.code, message=update.message))
    elif isinstance(update, FinishedUpdate) and update.finish_reason == "cancelled":
        log.emit(RequestCancelled(reason=serving.cancel_reason, output_tokens=len(serving.generated)))
    elif isinstance(update, FinishedUpdate):
        log.emit(
            RequestFinished(
                finish_reason=update.finish_reason,
                prompt_tokens=serving.prompt_tokens,
                output_tokens=len(serving.generated),
                e2e_s=timings.e2e_s or 0.0,
                ttft_s=timings.ttft_s,
                tpot_s=timings.tpot_s,
            )
        )
