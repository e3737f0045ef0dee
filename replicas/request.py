"""A request in flight: what every replica that touches it reads and writes, and how it reports back.

A `ServingRequest` is created by the router when a `generate` is admitted and lives until its final
update. It is what was asked — its `RequestSpec`: prompt, images, sampling (grammar included), token
limit, log-probability asks, id; frozen, so no part of the node can change it — plus its progress: the
laid-out prompt, tokens, scores, stamps, transfers, KV hints, its end and who holds it.

At any moment exactly one party *holds* it (the router's queue, one replica's queue or batch, or one
migration) — the holder is the only one that changes its KV tables or appends tokens; the others only
read. The request changes hands through one method, `hand_to`, the only writer of `holder`.

Updates to the client travel through `updates`, a channel the control handler drains; its buffer is
larger than the number of updates a request can ever produce, so replicas never block on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal, final

import numpy as np
import torch
import trio

from messages.control import ErrorCode
from messages.control_replies import RelayInfo, Timings, TransferSummary
from replicas.model import ImageGrid, SamplingParams, TokenLogprobs
from replicas.model.text.grammar import GrammarState

FinishReason = Literal["stop", "length", "cancelled"]
CancelReason = Literal["cancel_op", "client_disconnected", "client_too_slow", "shutdown"]


@final
@dataclass(frozen=True, slots=True)
class TokensUpdate:
    """New tokens, in order."""

    token_ids: tuple[int, ...]


@final
@dataclass(frozen=True, slots=True)
class FinishedUpdate:
    """The final update of a request that ended normally (or was cancelled)."""

    finish_reason: FinishReason


@final
@dataclass(frozen=True, slots=True)
class FailedUpdate:
    """The final update of a request that failed."""

    code: ErrorCode
    message: str


RequestUpdate = TokensUpdate | FinishedUpdate | FailedUpdate


@final
@dataclass(frozen=True, slots=True)
class EmbeddingRoute:
    """Where an image request's embeddings come from: encode replica `encoder` sends them as transfer
    `transfer_id` (both sides use this id) to the prefill replica that holds the request."""

    encoder: str
    transfer_id: str


@final
class RequestCancelled(Exception):
    """Raised inside a replica's work on a request that was cancelled meanwhile."""


@final
@dataclass(slots=True)
class Stamps:
    """Wall-clock seconds (`time.time()`) of the request's milestones; None until reached."""

    arrived: float = field(default_factory=time.time)
    dispatched: float | None = None
    encode_started: float | None = None
    encode_finished: float | None = None
    embedding_started: float | None = None
    embedding_finished: float | None = None
    prefill_started: float | None = None
    prefill_finished: float | None = None
    kv_started: float | None = None
    kv_finished: float | None = None
    first_token: float | None = None
    finished: float | None = None


@final
@dataclass(frozen=True, slots=True, eq=False)
class RequestSpec:
    """What a client asked for: fixed when the request is admitted (or, for a mirror on another node,
    rebuilt from the origin's snapshot) and never changed after. Everything a replica learns or does on
    the request — its layout, tokens, stamps, holder — is its progress, on `ServingRequest`.

    `logprobs`: alternatives to report for each generated token; `prompt_logprobs`: for each prompt
    token (`replicas.model.executor.logprobs`); None: not asked for."""

    request_id: str
    prompt_ids: tuple[int, ...]
    images: tuple[np.ndarray, ...]
    sampling: SamplingParams
    max_tokens: int
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @staticmethod
    def of(
        *,
        request_id: str,
        prompt_ids: Sequence[int],
        images: Sequence[np.ndarray],
        sampling: SamplingParams,
        max_tokens: int,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> RequestSpec:
        """A spec from any sequences (kept as tuples)."""
        return RequestSpec(
            request_id=request_id,
            prompt_ids=tuple(prompt_ids),
            images=tuple(images),
            sampling=sampling,
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )


@final
class ServingRequest:
    """One admitted `generate`: its `spec` (what was asked, frozen) and its progress (the rest), which
    only its holder changes. See the module docstring for who may change what."""

    def __init__(self, spec: RequestSpec, *, eos_token_ids: Sequence[int]) -> None:
        self._spec = spec
        # The end-of-sequence tokens the request stops at: the admitting node's, then those of the model
        # that prefills it (set by the prefill replica when its prefill starts).
        self.eos_token_ids = tuple(eos_token_ids)
        self.generated: list[int] = []
        # Log-probabilities, where the spec asks for them: those of each generated token in
        # `generated_logprobs` (its index is the token's in `generated`), those of each prompt token in
        # `prompt_scores` (the first one's None: nothing comes before it).
        self.generated_logprobs: list[TokenLogprobs] = []
        self.prompt_scores: list[TokenLogprobs | None] = []
        self.stamps = Stamps()
        self.transfers: list[TransferSummary] = []
        # Filled once the prompt is laid out (images expanded: after the embedding transfer).
        self.token_ids: list[int] = list(spec.prompt_ids) if not spec.images else []
        self.positions: torch.Tensor | None = None
        self.next_position: int = len(self.token_ids)
        # Prompt tokens whose KV the holding prefill replica's blocks already hold (a chunked prefill's
        # finished chunks): the next prefill call starts at this position.
        self.prefilled = 0
        self.image_grids: list[ImageGrid] = []
        self.embeds: torch.Tensor | None = None
        self.embed_indices: torch.Tensor | None = None
        self.embedding_route: EmbeddingRoute | None = None  # set by the router for an image request
        self.cached_tokens = 0  # prompt tokens whose KV came from the prefix cache (not computed)
        self.cached_from: str | None = None  # "local", or the replica they were pulled from
        # The router's pull hint: replica `pull_from` holds the prompt's first `pull_blocks` full blocks
        # (docs/prefix-cache.md); `pulling` while its prefill replica pulls them (it waits to run).
        self.pull_from: str | None = None
        self.pull_blocks = 0
        self.pulling = False
        self.cancelled = False
        self.ended = False
        self.cancel_reason: CancelReason = "cancel_op"
        self.final_update: FinishedUpdate | FailedUpdate | None = None
        # Set by `stop_early`: the request ends `stop` with this many generated tokens kept.
        self.stop_at: int | None = None
        self._holder: str | None = None  # see `holder` and `hand_to`
        self.relay: RelayInfo | None = None  # set when its prefill was relayed (ZigZag)
        # The matcher of `sampling.grammar` on this node, rebuilt from the spec and `generated` wherever
        # the request is sampled (`replicas.step.grammar`); only the holder's compute call touches it.
        self.grammar_state: GrammarState | None = None
        self._update_send, self.updates = trio.open_memory_channel[RequestUpdate](spec.max_tokens + 4)
        self.cancel_hooks: list[trio.CancelScope] = []
        self.on_end: list[Callable[[ServingRequest], None]] = []
        # Subscribers (engine.cluster): told of every token emitted here, with its index in `generated` —
        # a mirror of a request admitted on another node, so the request's origin hears of it; and told
        # of a cancel — a request other nodes work on, so they hear of it.
        self.on_tokens: list[Callable[[int, Sequence[int]], None]] = []
        self.on_cancel: list[Callable[[ServingRequest], None]] = []

    # ------------------------------------------------------------------ the spec
    @property
    def spec(self) -> RequestSpec:
        """What was asked (frozen; read-only here too)."""
        return self._spec

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.spec.prompt_ids

    @property
    def images(self) -> tuple[np.ndarray, ...]:
        return self.spec.images

    @property
    def sampling(self) -> SamplingParams:
        return self.spec.sampling

    @property
    def max_tokens(self) -> int:
        return self.spec.max_tokens

    @property
    def logprobs(self) -> int | None:
        return self.spec.logprobs

    @property
    def prompt_logprobs(self) -> int | None:
        return self.spec.prompt_logprobs

    # ------------------------------------------------------------------ holding
    @property
    def holder(self) -> str | None:
        """The replica holding the request now, by name (a cluster name for another node's replica);
        None: the router's queue or a migration between holders holds it."""
        return self._holder

    def hand_to(self, holder: str | None) -> None:
        """Hand the request to `holder` (a replica's name; None: back to the router or into a move).

        The only writer of `holder`: whoever takes the request (a replica queueing or reserving it, the
        cluster books learning which replica holds it) or gives it back (a replica returning it, a
        relay handing it on) calls it, so that at any moment exactly one party holds the request and
        every reader sees which."""
        self._holder = holder

    # ------------------------------------------------------------------ facts
    @property
    def has_images(self) -> bool:
        return bool(self.images)

    @property
    def needs_embeddings(self) -> bool:
        """Images whose embeddings have not landed yet: an encode replica and a transfer are needed."""
        return bool(self.images) and not self.token_ids

    @property
    def prompt_ready(self) -> bool:
        """The token ids (images expanded) and embeddings are known: prefill may run."""
        return bool(self.token_ids)

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_tokens(self) -> int:
        """Tokens whose KV a decode step attends to: prompt plus all but the newest generated token."""
        return len(self.token_ids) + max(0, len(self.generated) - 1)

    def decode_position(self) -> int:
        """Rotary position of the newest generated token (fed at the next decode step)."""
        return self.next_position + len(self.generated) - 1

    def kv_capacity_tokens(self, context_length: int) -> int:
        """Tokens of KV the request may ever hold: prompt + max_tokens - 1, capped by the context."""
        return min(len(self.token_ids) + self.max_tokens - 1, context_length)

    # ------------------------------------------------------------------ reporting
    def emit_tokens(self, token_ids: Sequence[int]) -> None:
        if not self.ended and token_ids:
            if self.stamps.first_token is None:
                self.stamps.first_token = time.time()
            self._update_send.send_nowait(TokensUpdate(tuple(token_ids)))
            for callback in list(self.on_tokens):
                callback(len(self.generated) - len(token_ids), token_ids)

    def finish(self, reason: FinishReason) -> None:
        """End normally. Idempotent with `fail`: the first final update wins. After `stop_early` the
        reason is `stop` and `generated` is cut to the tokens kept, whatever the holder saw last."""
        if not self.ended:
            if self.stop_at is not None:
                reason = "stop"
                del self.generated[self.stop_at :]
            self.ended = True
            self.stamps.finished = time.time()
            self.final_update = FinishedUpdate(reason)
            self._update_send.send_nowait(self.final_update)
            self._ended()

    def fail(self, code: ErrorCode, message: str) -> None:
        if not self.ended:
            self.ended = True
            self.stamps.finished = time.time()
            self.final_update = FailedUpdate(code, message)
            self._update_send.send_nowait(self.final_update)
            self._ended()

    def _ended(self) -> None:
        # Work still running on it stops too: a transfer whose other side failed the request (say its
        # link went silent) would otherwise wait for that peer until a timeout, holding its blocks.
        for scope in self.cancel_hooks:
            scope.cancel()
        for callback in self.on_end:
            callback(self)

    @contextmanager
    def work_scope(self) -> Iterator[trio.CancelScope]:
        """A cancel scope for work on this request (a transfer), cancelled when the request is cancelled
        or ends — wherever it ends; registered in `cancel_hooks` while open."""
        with trio.CancelScope() as scope:
            self.cancel_hooks.append(scope)
            try:
                yield scope
            finally:
                self.cancel_hooks.remove(scope)

    def cancel(self) -> None:
        """Mark cancelled and interrupt whatever work on it can be interrupted (transfers in flight).

        The holder notices `cancelled` at its next step boundary, frees the request's blocks and
        reports `finish("cancelled")`."""
        self.cancelled = True
        for scope in self.cancel_hooks:
            scope.cancel()
        for callback in list(self.on_cancel):
            callback(self)

    def stop_early(self, kept_tokens: int) -> None:
        """A stop string ended the text within the first `kept_tokens` generated tokens: stop generating
        (as `cancel` does) and end `stop` with only those tokens."""
        if self.stop_at is None:
            self.stop_at = kept_tokens
        self.cancel()

    def timings(self) -> Timings:
        s = self.stamps

        def span(start: float | None, end: float | None) -> float | None:
            return None if start is None or end is None else max(0.0, end - start)

        generated = len(self.generated)
        tpot = None
        if s.first_token is not None and s.finished is not None and generated > 1:
            tpot = max(0.0, s.finished - s.first_token) / (generated - 1)
        queued_until = s.encode_started or s.prefill_started
        return Timings(
            queued_s=span(s.arrived, queued_until),
            encode_s=span(s.encode_started, s.encode_finished),
            embedding_transfer_s=span(s.embedding_started, s.embedding_finished),
            prefill_s=span(s.prefill_started, s.prefill_finished),
            kv_transfer_s=span(s.kv_started, s.kv_finished),
            ttft_s=span(s.arrived, s.first_token),
            tpot_s=tpot,
            e2e_s=span(s.arrived, s.finished),
        )
