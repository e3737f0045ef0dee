"""A request in flight: what every replica that touches it reads and writes, and how it reports back.

A `ServingRequest` is created by the router when a `generate` is admitted and lives until its final
update. It is what was asked — its `RequestSpec`: prompt, images, sampling (grammar included), token
limit, log-probability asks, id; frozen, so no part of the node can change it — plus its progress: the
laid-out prompt, tokens, scores, stamps, transfers, KV hints, its end and who holds it.

At any moment exactly one party *holds* it (the router's queue, one replica's queue or batch, or one
migration) — the holder is the only one that changes its progress; the others only read. The request
changes hands through one method, `hand_to`, the only writer of `holder`. Progress is private to the
request and read through properties; the holder changes it through methods named by what happened
(`stamp`, `laid_out`, `prefill_from`, `prefilled_to`, `add_token`, `cancel`, ...), each keeping the
invariants `ServingRequest` states.

Across nodes: the node that admitted a request (its origin) keeps the authoritative object; a node that
works on it holds a mirror. Progress made on another node lands on this node's object through one
method, `merge` (a `HolderReport`: a snapshot sent with a command, the tokens a mirror's holder
emitted, how it ended there), which only adds what this node does not know (`merge` says exactly).

Updates to the client travel through `updates`, a channel the control handler drains; its buffer is
larger than the number of updates a request can ever produce, so replicas never block on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Literal, final

import numpy as np
import torch
import trio

from messages.control import ErrorCode
from messages.control_replies import RelayInfo, Timings, TransferSummary
from messages.grammar import Grammar
from replicas.embedding import EmbeddedPrompt
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


Milestone = Literal[
    "dispatched",
    "encode_started",
    "encode_finished",
    "embedding_started",
    "embedding_finished",
    "prefill_started",
    "prefill_finished",
    "kv_started",
    "kv_finished",
]
"""The milestones the parts that hold a request stamp (`ServingRequest.stamp`); `arrived`, `first_token`
and `finished` the request stamps itself (created, first token emitted, ended)."""


@final
@dataclass(frozen=True, slots=True)
class Stamps:
    """Wall-clock seconds (`time.time()`) of the request's milestones; None until reached. Frozen: the
    request replaces its stamps as milestones are reached (`ServingRequest.stamp`)."""

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
@dataclass(frozen=True, slots=True, kw_only=True)
class HolderReport:
    """What another node reports of a request's progress there (`ServingRequest.merge`): a snapshot of
    the request it sent along with a command, the tokens its holder emitted, or how the request ended
    there. Empty fields report nothing.

    `tokens_from`: the index in `generated` of the first of `generated` (0: the whole list);
    `emit`: stream the tokens this node did not have to the client; `next_position` (with `token_ids`):
    where positions continue after the laid-out prompt (None: the report does not say); `pull`: the
    router's pull hint as the sender set it (None: not reported); `stamps`: milestones by name."""

    tokens_from: int = 0
    generated: Sequence[int] = ()
    generated_logprobs: Sequence[TokenLogprobs] = ()
    emit: bool = True
    token_ids: Sequence[int] = ()
    next_position: int | None = None
    prompt_scores: Sequence[TokenLogprobs | None] = ()
    stamps: Mapping[str, float | None] = field(default_factory=dict)
    cached_tokens: int = 0
    cached_from: str | None = None
    pull: tuple[str | None, int] | None = None
    stop_at: int | None = None
    embedding_route: EmbeddingRoute | None = None
    cancelled: bool = False


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
    only its holder changes, through the methods below. See the module docstring for who may change
    what.

    Progress is private storage behind read-only properties (a list is handed out as a `Sequence`: read
    it, never change it); each method is named by what happened and keeps these invariants:

    - `generated` only grows, except that an end after `stop_early` cuts it to `stop_at` tokens;
      `generated_logprobs[i]` scores `generated[i]` and is never longer than it.
    - `prefilled` (the prompt tokens whose KV the holding prefill replica holds) is within
      `[0, prompt_tokens]`; `cached_tokens` counts only prompt tokens, and `cached_from` is None while
      `cached_tokens` is 0 on this node.
    - A milestone's stamp is None until reached; `arrived`, `first_token` and `finished` are stamped by
      the request itself. `cancelled` and `ended` never go back to False; `final_update` is set once.
    """

    def __init__(self, spec: RequestSpec, *, eos_token_ids: Sequence[int]) -> None:
        self._spec = spec
        # The end-of-sequence tokens the request stops at: the admitting node's, then those of the model
        # that prefills it (`started_prefill`).
        self._eos_token_ids = tuple(eos_token_ids)
        self._generated: list[int] = []
        # Log-probabilities, where the spec asks for them: those of each generated token in
        # `generated_logprobs` (its index is the token's in `generated`), those of each prompt token in
        # `prompt_scores` (the first one's None: nothing comes before it).
        self._generated_logprobs: list[TokenLogprobs] = []
        self._prompt_scores: list[TokenLogprobs | None] = []
        self._stamps = Stamps()
        self.transfers: list[TransferSummary] = []
        # Filled once the prompt is laid out (images expanded: after the embedding transfer).
        self._token_ids: list[int] = list(spec.prompt_ids) if not spec.images else []
        self._positions: torch.Tensor | None = None
        self._next_position: int = len(self._token_ids)
        self._prefilled = 0
        self._image_grids: list[ImageGrid] = []
        self._embeds: torch.Tensor | None = None
        self._embed_indices: torch.Tensor | None = None
        self._embedding_route: EmbeddingRoute | None = None
        self._cached_tokens = 0
        self._cached_from: str | None = None
        self._pull_from: str | None = None
        self._pull_blocks = 0
        self._pulling = False
        self._cancelled = False
        self._ended = False
        self._cancel_reason: CancelReason = "cancel_op"
        self._cancel_reason_noted = False
        self._final_update: FinishedUpdate | FailedUpdate | None = None
        self._stop_at: int | None = None
        self._holder: str | None = None  # see `holder` and `hand_to`
        self.relay: RelayInfo | None = None  # set when its prefill was relayed (ZigZag)
        self._grammar_state: GrammarState | None = None
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
        return self._spec.request_id

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self._spec.prompt_ids

    @property
    def images(self) -> tuple[np.ndarray, ...]:
        return self._spec.images

    @property
    def sampling(self) -> SamplingParams:
        return self._spec.sampling

    @property
    def max_tokens(self) -> int:
        return self._spec.max_tokens

    @property
    def logprobs(self) -> int | None:
        return self._spec.logprobs

    @property
    def prompt_logprobs(self) -> int | None:
        return self._spec.prompt_logprobs

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

    # ------------------------------------------------------------------ progress, read-only
    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The end-of-sequence tokens the request stops at (see `started_prefill`)."""
        return self._eos_token_ids

    @property
    def generated(self) -> Sequence[int]:
        """The tokens generated so far, in order."""
        return self._generated

    @property
    def generated_logprobs(self) -> Sequence[TokenLogprobs]:
        """The log-probabilities of `generated[: len(generated_logprobs)]`, where asked."""
        return self._generated_logprobs

    @property
    def prompt_scores(self) -> Sequence[TokenLogprobs | None]:
        """The prompt tokens' log-probabilities computed so far, where asked (the first one's None)."""
        return self._prompt_scores

    @property
    def stamps(self) -> Stamps:
        return self._stamps

    @property
    def token_ids(self) -> Sequence[int]:
        """The prompt as laid out (images expanded); empty until an image request's embeddings land."""
        return self._token_ids

    @property
    def positions(self) -> torch.Tensor | None:
        """The laid-out prompt's rotary positions (an image request's; None: `range(prompt_tokens)`)."""
        return self._positions

    @property
    def next_position(self) -> int:
        """The position after the laid-out prompt, where the generated tokens' positions start."""
        return self._next_position

    @property
    def prefilled(self) -> int:
        """Prompt tokens whose KV the holding prefill replica's blocks already hold (a chunked prefill's
        finished chunks): the next prefill call starts at this position."""
        return self._prefilled

    @property
    def image_grids(self) -> Sequence[ImageGrid]:
        return self._image_grids

    @property
    def embeds(self) -> torch.Tensor | None:
        """The landed embedding rows of an image request (until its prefill no longer needs them)."""
        return self._embeds

    @property
    def embed_indices(self) -> torch.Tensor | None:
        """Where in the laid-out prompt each row of `embeds` goes."""
        return self._embed_indices

    @property
    def embedding_route(self) -> EmbeddingRoute | None:
        """Where an image request's embeddings come from (set by the router when it dispatches it)."""
        return self._embedding_route

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV came from the prefix cache (not computed)."""
        return self._cached_tokens

    @property
    def cached_from(self) -> str | None:
        """Where the cached tokens came from: "local", or the replica they were pulled from; None: none."""
        return self._cached_from

    @property
    def pull_from(self) -> str | None:
        """The router's pull hint: replica `pull_from` holds the prompt's first `pull_blocks` full blocks
        (docs/prefix-cache.md)."""
        return self._pull_from

    @property
    def pull_blocks(self) -> int:
        return self._pull_blocks

    @property
    def pulling(self) -> bool:
        """The holding prefill replica pulls the prompt's cached blocks (the request waits to run)."""
        return self._pulling

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def ended(self) -> bool:
        return self._ended

    @property
    def cancel_reason(self) -> CancelReason:
        """Why the request was cancelled (`note_cancel_reason`); `cancel_op` unless another was noted."""
        return self._cancel_reason

    @property
    def final_update(self) -> FinishedUpdate | FailedUpdate | None:
        return self._final_update

    @property
    def stop_at(self) -> int | None:
        """Set by `stop_early`: the request ends `stop` with this many generated tokens kept."""
        return self._stop_at

    @property
    def grammar_state(self) -> GrammarState | None:
        """The matcher of `sampling.grammar` on this node (see `grammar_matcher`), or None."""
        return self._grammar_state

    # ------------------------------------------------------------------ facts
    @property
    def has_images(self) -> bool:
        return bool(self.images)

    @property
    def needs_embeddings(self) -> bool:
        """Images whose embeddings have not landed yet: an encode replica and a transfer are needed."""
        return bool(self.images) and not self._token_ids

    @property
    def prompt_ready(self) -> bool:
        """The token ids (images expanded) and embeddings are known: prefill may run."""
        return bool(self._token_ids)

    @property
    def prompt_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def context_tokens(self) -> int:
        """Tokens whose KV a decode step attends to: prompt plus all but the newest generated token."""
        return len(self._token_ids) + max(0, len(self._generated) - 1)

    def decode_position(self) -> int:
        """Rotary position of the newest generated token (fed at the next decode step)."""
        return self._next_position + len(self._generated) - 1

    def kv_capacity_tokens(self, context_length: int) -> int:
        """Tokens of KV the request may ever hold: prompt + max_tokens - 1, capped by the context."""
        return min(len(self._token_ids) + self.max_tokens - 1, context_length)

    # ------------------------------------------------------------------ progress: what happened
    def stamp(self, milestone: Milestone, at: float | None = None) -> None:
        """`milestone` was reached at `at` (default: now). A milestone reached again (a prefill that
        starts over on another replica) keeps the latest time."""
        self._stamps = replace(self._stamps, **{milestone: time.time() if at is None else at})

    def stamp_first(self, milestone: Milestone, at: float | None = None) -> None:
        """`milestone` was reached at `at` (default: now), unless it was already: the first time stays."""
        if getattr(self._stamps, milestone) is None:
            self.stamp(milestone, at)

    def route_embeddings(self, route: EmbeddingRoute | None) -> None:
        """The router sends the images to `route`'s encoder (None: that dispatch was taken back)."""
        self._embedding_route = route

    def hint_pull(self, pull_from: str | None, blocks: int) -> None:
        """The router found the prompt's first `blocks` full blocks cached on replica `pull_from` (None,
        0: nowhere worth pulling from)."""
        self._pull_from, self._pull_blocks = pull_from, blocks

    def pull_started(self) -> None:
        """The holding prefill replica started pulling the cached blocks: the request waits to run."""
        self._pulling = True

    def pull_ended(self) -> None:
        """The pull ended (landed, or failed): the request may run."""
        self._pulling = False

    def laid_out(self, prompt: EmbeddedPrompt) -> None:
        """An image request's embeddings landed: its prompt is laid out (`prompt_ready` from now on)."""
        self._token_ids = list(prompt.token_ids)
        self._positions = prompt.positions
        self._next_position = prompt.next_position
        self._embeds = prompt.embeds
        self._embed_indices = prompt.embed_indices
        self._image_grids = list(prompt.grids)

    def drop_embeddings(self) -> None:
        """The landed embedding rows are no longer needed (they live in host tensors, not pool blocks);
        the layout stays."""
        self._embeds = None
        self._embed_indices = None

    def prefill_from(self, cached_tokens: int, cached_from: str | None) -> None:
        """A new prefill starts after `cached_tokens` prompt tokens whose KV came from the prefix cache
        (`cached_from`: "local" or the replica they were pulled from; None with 0 tokens): `prefilled`
        starts there. Raises `ValueError` past the prompt."""
        if not 0 <= cached_tokens <= len(self._token_ids):
            raise ValueError(
                f"request {self.request_id}: {cached_tokens} cached tokens of a {len(self._token_ids)}-token "
                "prompt"
            )
        self._cached_tokens = self._prefilled = cached_tokens
        self._cached_from = cached_from if cached_tokens else None

    def started_prefill(self, eos_token_ids: Sequence[int], at: float) -> None:
        """A prefill replica started the prompt at `at`: the request stops at its model's EOS tokens."""
        self._eos_token_ids = tuple(eos_token_ids)
        self.stamp("prefill_started", at)

    def prefilled_to(self, position: int) -> None:
        """A chunk of the prompt ran: the KV of its first `position` tokens is in the holder's blocks.
        Raises `ValueError` when `position` goes back or past the prompt."""
        if not self._prefilled <= position <= len(self._token_ids):
            raise ValueError(
                f"request {self.request_id}: prefilled to {position} after {self._prefilled} of "
                f"{len(self._token_ids)} prompt tokens"
            )
        self._prefilled = position

    def prompt_scored(self, scored: Sequence[TokenLogprobs | None]) -> None:
        """A prefill call scored the next prompt tokens (the first call's first entry is the None of the
        first token, which nothing comes before)."""
        self._prompt_scores = [*(self._prompt_scores or [None]), *scored]

    def released_blocks(self) -> None:
        """The holder gave the request's KV blocks back: none of the prompt's KV is held (`prefilled` 0);
        what it computed (its first token, scores) stays."""
        self._prefilled = 0

    def restart_prefill(self) -> None:
        """The chunks that ran are forgotten (the blocks went back): the prefill starts over, scores too."""
        self._prefilled = 0
        self._prompt_scores = []

    def grammar_matcher(self, start: Callable[[Grammar], GrammarState]) -> GrammarState:
        """The matcher of `sampling.grammar`, caught up with `generated`: the one kept on this node, or
        one `start` builds from the spec when there is none or it saw tokens the request no longer has.
        Only the holder's compute call touches it (one at a time)."""
        spec = self.sampling.grammar
        assert spec is not None, "grammar_matcher on a request without a grammar"
        state = self._grammar_state
        if state is None or state.spec != spec or state.consumed > len(self._generated):
            state = self._grammar_state = start(spec)
        state.catch_up(self._generated)
        return state

    def add_token(self, token: int, scored: TokenLogprobs | None = None) -> None:
        """The holder sampled the next token (scored, where asked): appended and streamed."""
        if scored is not None and len(self._generated_logprobs) == len(self._generated):
            self._generated_logprobs.append(scored)
        self._generated.append(token)
        self._emit_tokens([token])

    def note_cancel_reason(self, reason: CancelReason) -> None:
        """Why the cancel that follows is asked for (a client gone, the node shutting down); the first
        reason noted stays."""
        if not self._cancel_reason_noted:
            self._cancel_reason, self._cancel_reason_noted = reason, True

    def merge(self, report: HolderReport) -> None:
        """Bring this node's copy of the request up to what another node reports of it (a snapshot sent
        with a command, the tokens its holder emitted, the outcome there): the one way progress made on
        another node lands here.

        The rule: a report only adds what this node does not know, never takes back — the tokens past
        the ones this node has, in index order (a token it has is skipped; a report that starts past
        them waits for the gap to come with a later one); milestones not stamped here; the prompt's
        layout (and scores) when this node has none, or the report says where positions continue; the
        larger count of cached tokens; the first `stop_at`; a cancel. Only the router's hints (the pull,
        the embedding route) are taken as the sender set them. An ended request takes no tokens."""
        if report.token_ids and (report.next_position is not None or not self._token_ids):
            self._token_ids = list(report.token_ids)
            if report.next_position is not None:
                self._next_position = report.next_position
        self._merge_tokens(report)
        if report.prompt_scores and not self._prompt_scores:
            self._prompt_scores = list(report.prompt_scores)
        merged: dict[str, float] = {
            name: value
            for name, value in report.stamps.items()
            if value is not None and getattr(self._stamps, name) is None
        }
        if merged:
            self._stamps = replace(self._stamps, **merged)
        if report.cached_tokens >= self._cached_tokens and report.cached_from is not None:
            self._cached_from = report.cached_from
        self._cached_tokens = max(self._cached_tokens, report.cached_tokens)
        if report.pull is not None:
            self.hint_pull(*report.pull)
        if report.stop_at is not None and self._stop_at is None:
            self._stop_at = report.stop_at
        if report.embedding_route is not None:
            self._embedding_route = report.embedding_route
        if report.cancelled and not self._cancelled:
            self.cancel()

    def _merge_tokens(self, report: HolderReport) -> None:
        have, start = len(self._generated), report.tokens_from
        if start > have or self._ended:
            return  # a gap: the tokens before these arrive with a snapshot or the final update
        new = list(report.generated[have - start :])
        if not new:
            return
        logprobs = report.generated_logprobs
        if logprobs and len(self._generated_logprobs) == have:
            self._generated_logprobs.extend(logprobs[have - start :])
        self._generated.extend(new)
        if report.emit:
            self._emit_tokens(new)

    # ------------------------------------------------------------------ reporting
    def _emit_tokens(self, token_ids: Sequence[int]) -> None:
        """Stream `token_ids`, the newest of `generated`, to the client and the `on_tokens` subscribers
        (nothing once ended); the first ones stamp `first_token`."""
        if not self._ended and token_ids:
            if self._stamps.first_token is None:
                self._stamps = replace(self._stamps, first_token=time.time())
            self._update_send.send_nowait(TokensUpdate(tuple(token_ids)))
            for callback in list(self.on_tokens):
                callback(len(self._generated) - len(token_ids), token_ids)

    def finish(self, reason: FinishReason) -> None:
        """End normally. Idempotent with `fail`: the first final update wins. After `stop_early` the
        reason is `stop` and `generated` is cut to the tokens kept, whatever the holder saw last."""
        if not self._ended:
            if self._stop_at is not None:
                reason = "stop"
                del self._generated[self._stop_at :]
                del self._generated_logprobs[self._stop_at :]
            self._ended = True
            self._stamps = replace(self._stamps, finished=time.time())
            self._final_update = FinishedUpdate(reason)
            self._update_send.send_nowait(self._final_update)
            self._end_work()

    def fail(self, code: ErrorCode, message: str) -> None:
        if not self._ended:
            self._ended = True
            self._stamps = replace(self._stamps, finished=time.time())
            self._final_update = FailedUpdate(code, message)
            self._update_send.send_nowait(self._final_update)
            self._end_work()

    def _end_work(self) -> None:
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
        self._cancelled = True
        for scope in self.cancel_hooks:
            scope.cancel()
        for callback in list(self.on_cancel):
            callback(self)

    def stop_early(self, kept_tokens: int) -> None:
        """A stop string ended the text within the first `kept_tokens` generated tokens: stop generating
        (as `cancel` does) and end `stop` with only those tokens."""
        if self._stop_at is None:
            self._stop_at = kept_tokens
        self.cancel()

    def timings(self) -> Timings:
        s = self._stamps

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
