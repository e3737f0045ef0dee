"""Prefill behaviour: batch the work queue within a block budget, run the prompt, sample the first token.

Plan → execute → apply: `plan` decides the next batch as a value (`replicas.prefill.schedule.BatchPlan`:
which requests, which tokens of each, which prefix each new prompt borrows or takes from its pull, how
many blocks each allocates) without touching anything; `execute` only does what it says — takes the
requests off the queue, borrows, allocates, stamps and logs — and returns the running `Batch`; the
prompts run through every layer and the head in a worker thread (`replicas.step.compute`), and the
result is applied from that `Batch` in one place (`_finished`, then `complete` through
`replicas.step.apply.apply_tokens`): each first token streamed; finished requests free their blocks,
the others go to the migration queue, which moves their KV to a decode replica. A batch the model
refuses fails its requests with `bad_request`.

Chunked prefill (`ReplicaSettings.chunk_tokens`): the plan cuts a long prompt into chunks; a batch runs
each chunk from its start position over the KV of the chunks before it (in the request's blocks,
allocated with the first chunk and kept in `_tables` between chunks); a chunk that does not end its
prompt samples nothing — its request goes back to the front of the queue, its next chunk first in the
next batch — and the one that does is applied like a whole prompt. The KV moves to the decode replica
once the whole prompt ran (not chunk by chunk).

Image requests: enqueued, they start receiving their embeddings at once (`replicas.prefill.embeddings`);
the schedule skips them until the prompt is laid out. A request whose KV partly lives on a ZigZag
partner (`Held.relay`) has that half dropped there when it ends here.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import assert_never, final

import torch

from messages.commands import DropKVHalf
from messages.log.events import PrefillStarted
from replicas.inbox import new_command_id
from replicas.model import KVCache, Model, ModelInputError, PrefillResult, PrefillSequence, token_history
from replicas.ports import Actor, Directory, tell_peer
from replicas.prefill.embeddings import EmbeddingReceives, release_input
from replicas.prefill.prefix import PrefixLookup
from replicas.prefill.pull import Puller
from replicas.prefill.queue import PromptQueue
from replicas.prefill.schedule import (
    BatchPlan,
    Borrow,
    Candidate,
    Fresh,
    Line,
    PlanBroken,
    Prefix,
    Pulled,
    plan_batch,
)
from replicas.request import ServingRequest
from replicas.settings import ReplicaSettings
from replicas.states import KEEPS_IMAGE_REQUESTS, ReplicaState
from replicas.step.apply import apply_tokens, refuse
from replicas.step.compute import Compute
from replicas.step.grammar import grammar_rows
from replicas.step.plan import Held, PrefillCall

S = ReplicaState


@final
@dataclass(frozen=True, slots=True)
class Batch:
    """A batch as its plan ran: the plan's `lines` and, line for line, the requests with their tables
    (`items`) and the model call's `sequences`. Its result is applied from it (`PrefillWork._finished`)."""

    lines: tuple[Line, ...]
    items: tuple[Held, ...]
    sequences: tuple[PrefillSequence, ...]

    @property
    def tokens(self) -> int:
        """The prompt tokens the batch computes."""
        return sum(line.tokens for line in self.lines)


@final
class PrefillWork:
    """The prefill role of one replica (see the module docstring). `migrate` takes a prefilled request
    whose KV goes to a decode replica; `returned` gives a request back to the router; `changed` tells
    the node that the replica's readiness changed (room in its queue)."""

    def __init__(
        self,
        actor: Actor,
        *,
        queue: PromptQueue,
        kv: KVCache,
        settings: ReplicaSettings,
        compute: Compute,
        embeddings: EmbeddingReceives | None,
        directory: Directory,
        migrate: Callable[[Held], None],
        returned: Callable[[ServingRequest], None],
        changed: Callable[[], None],
        puller: Puller | None = None,
    ) -> None:
        """`puller`: pulls a prefix another replica caches, when the router's hint names one."""
        self._actor = actor
        self._puller = puller
        self.queue = queue
        self._kv = kv
        self._prefix = PrefixLookup(kv.prefix)
        self._settings = settings
        self._compute = compute
        self._embeddings = embeddings
        self._directory = directory
        self._migrate = migrate
        self._returned = returned
        self._changed = changed
        self.running: Batch | None = None  # the batch computing now
        self._tables: dict[str, list[int]] = {}  # the blocks of queued requests whose first chunks ran

    @property
    def running_tokens(self) -> int:
        """The prompt tokens of the batch computing now (0: none)."""
        return 0 if self.running is None else self.running.tokens

    def enqueue(self, request: ServingRequest) -> None:
        request.hand_to(self._actor.name)
        self.queue.append(request)
        if request.needs_embeddings:
            if self._embeddings is None:
                self.queue.remove(request)
                release_input(request)
                request.fail(
                    "internal",
                    f"request {request.request_id} cannot receive its image embeddings: "
                    f"{self._actor.name} has no embedding pool",
                )
                return
            self._embeddings.start(request)
        elif request.pull_from is not None and self._puller is not None and self._actor.state is S.PREFILL:
            self._puller.start(request)

    def return_queued(self, why: str) -> None:
        """Give queued requests whose prompt has not started back to the router (state change); a
        chunked prompt whose first chunks ran here starts again elsewhere (its blocks go back)."""
        for request in self.queue.take_all():
            if (request.has_images and not request.prompt_ready) or request.pulling:
                self.queue.append(request)  # its embeddings or prefix are landing here; finish first
                continue
            self._restart(request)
            request.hand_to(None)
            self._returned(request)

    def hand_back(self, room: Callable[[ServingRequest], bool]) -> int:
        """Give the oldest queued prompts that have not started back to the router, in order, while
        `room` says one more goes (ZigZag: an OldPrefill's prompts its NewPrefill partner takes, which
        it then gets first, at the front of the router's queue); the first that does not go, and every
        prompt behind it, stays. Returns how many went."""
        going: list[ServingRequest] = []
        for request in self.queue:
            started = request.request_id in self._tables or request.prefilled
            if started or request.has_images or request.pulling or request.cancelled or not room(request):
                break
            going.append(request)
        for request in reversed(going):  # each goes to the router's front: the oldest last
            self.queue.remove(request)
            request.hand_to(None)
            self._returned(request)
        if going:
            self._changed()
        return len(going)

    def pull_ended(self, request: ServingRequest) -> None:
        """`request`'s pull ended (`replicas.prefill.pull`): it may run — or, when the replica stopped
        taking prompts meanwhile (`return_queued` kept it while its blocks were landing), it goes back to
        the router."""
        if request in self.queue and self._actor.state not in KEEPS_IMAGE_REQUESTS:
            self.queue.remove(request)
            self._restart(request)
            request.hand_to(None)
            self._returned(request)
        self._changed()

    def cancel_sweep(self) -> None:
        """Finish queued requests that were cancelled (their embedding transfers end on their own)."""
        receiving = self._embeddings.receiving if self._embeddings is not None else lambda _: False
        for request in [r for r in self.queue if r.cancelled and not receiving(r) and not r.pulling]:
            self.queue.remove(request)
            self._restart(request)
            release_input(request)
            request.finish("cancelled")

    def _restart(self, request: ServingRequest) -> None:
        """Forget the chunks of `request` that ran here: its blocks go back, its prefill starts over."""
        table = self._tables.pop(request.request_id, None)
        if table is not None:
            self._kv.release(table, request.request_id)
        if self._puller is not None:
            self._puller.drop(request.request_id)
        request.restart_prefill()

    # ------------------------------------------------------------------ a batch
    def start_batch(self) -> None:
        """Plan, execute and apply the next batch (main loop, no compute running)."""
        executor = self._compute.executor
        if executor is None or not self.queue:
            return
        plan = self.plan()
        if not plan:
            return
        batch = self.execute(plan)
        self.running = batch
        grammars = grammar_rows([item.request for item in batch.items], [line.last for line in batch.lines])
        call = PrefillCall(batch.sequences, grammars=grammars)
        self._compute.run(
            lambda: call.run(executor),
            functools.partial(self._finished, batch),
            functools.partial(self._refused, batch),
            emulated=self._compute.emulated_prefill(batch.tokens, self._compute.num_layers),
        )

    def plan(self, *, chunked: bool = True, cached: bool = True) -> BatchPlan:
        """The next batch (`replicas.prefill.schedule.plan_batch`), nothing touched: a new prompt's cached
        prefix is looked up when `cached` (a batch that runs every layer here), and `chunked` false
        plans whole prompts (a ZigZag batch). Execute it (`execute`) in the same step of the main loop."""
        kv, settings = self._kv, self._settings
        return plan_batch(
            self._candidates(cached=cached),
            free_blocks=kv.pool.allocatable_blocks,
            block_size=kv.block_size,
            max_batch_size=settings.max_batch_size,
            max_batch_tokens=settings.max_batch_tokens,
            chunk_tokens=settings.chunk_tokens if chunked else None,
        )

    def _candidates(self, *, cached: bool) -> Iterator[Candidate]:
        """The queue as `plan_batch` reads it, a request's prefix looked up when it is reached."""
        model = self._compute.model
        for request in self.queue:
            ready = request.prompt_ready and not request.cancelled and not request.pulling
            prefix: Prefix | None = None
            if ready and request.request_id not in self._tables:
                prefix = self._prefix_of(request, model if cached else None)
            yield Candidate(request.request_id, request.prompt_tokens, request.prefilled, ready, prefix)

    def _prefix_of(self, request: ServingRequest, model: Model | None) -> Prefix:
        """What a new prompt would start with: the blocks its pull left it (when the batch borrows: a
        `model` to look up with), else its cached prefix (`model` None: nothing, a ZigZag batch). A
        prompt that scores its tokens runs every row: it borrows nothing (its blocks still join the
        cache, so later prompts — the other choices of its body — borrow them)."""
        scored = request.prompt_logprobs is not None
        pulled = self._puller.landed(request.request_id) if self._puller is not None else None
        if pulled is not None:
            blocks, source = pulled
            return Pulled(tuple(blocks), source) if model is not None and not scored else Fresh(tuple(blocks))
        if model is None:
            return Fresh()
        return self._prefix.look(request, model, share=not scored)

    def execute(self, plan: BatchPlan) -> Batch:
        """Do what `plan` (made in this step of the main loop) decided: take its requests off the queue,
        borrow each new prompt's prefix — all of them before any allocation, so that none is evicted to
        make room —, allocate their blocks, stamp and log the new ones as started. Raises `PlanBroken`
        when the cache or pool is not what the plan saw (only a bug gets there)."""
        kv, model = self._kv, self._compute.model
        queued = {request.request_id: request for request in self.queue}
        starts: dict[str, list[int]] = {}
        for line in plan.lines:
            rid = line.request_id
            match line.prefix:
                case None:
                    continue
                case Borrow() as borrow:
                    starts[rid] = self._prefix.borrow(rid, borrow)
                case Pulled(blocks=blocks):
                    starts[rid] = self._take_pulled(rid, blocks)
                case Fresh(drop=drop):
                    if drop:
                        kv.release(self._take_pulled(rid, drop), rid)
                    starts[rid] = []
                case _:
                    assert_never(line.prefix)
        items: list[Held] = []
        started: list[ServingRequest] = []
        for line in plan.lines:
            request = queued[line.request_id]
            if line.prefix is None:
                table = self._tables.pop(request.request_id)
            else:
                table = self._allocate(line, request, starts[request.request_id])
                started.append(request)
            self.queue.remove(request)
            items.append(Held(request, table))
        self._changed()  # room in the queue: the router may hand more
        now = time.time()
        eos = tuple(model.eos_token_ids) if model is not None else ()
        for request in started:
            request.started_prefill(eos, now)
            self._actor.log.bind(request_id=request.request_id).emit(
                PrefillStarted(
                    tokens=request.prompt_tokens,
                    batch_size=len(items),
                    cached_tokens=request.cached_tokens,
                    cached_from=request.cached_from,
                )
            )
        return Batch(
            plan.lines,
            tuple(items),
            tuple(_sequence(item, line) for item, line in zip(items, plan.lines, strict=True)),
        )

    def _take_pulled(self, request_id: str, blocks: tuple[int, ...]) -> list[int]:
        taken = self._puller.take(request_id) if self._puller is not None else None
        if taken is None or tuple(taken[0]) != blocks:
            raise PlanBroken(
                f"request {request_id}: the plan starts from pulled blocks {list(blocks)}, "
                f"the puller holds {None if taken is None else taken[0]}"
            )
        return taken[0]

    def _allocate(self, line: Line, request: ServingRequest, prefix: list[int]) -> list[int]:
        """A new prompt's table: `prefix`, then the blocks `line` allocates; its prefill starts after it."""
        assert line.prefix is not None
        kv, rid = self._kv, line.request_id
        allocated = kv.pool.try_allocate(line.allocate, rid)
        if allocated is None:
            raise PlanBroken(
                f"request {rid}: the plan allocates {line.allocate} blocks, the pool has "
                f"{kv.pool.allocatable_blocks} to give"
            )
        source = line.prefix.source if isinstance(line.prefix, Pulled) else None
        request.prefill_from(len(prefix) * kv.block_size, (source or "local") if prefix else None)
        if isinstance(line.prefix, Pulled) or (isinstance(line.prefix, Borrow) and line.prefix.counted):
            self._prefix.counted(request, request.cached_tokens)
        return prefix + allocated

    def _finished(self, batch: Batch, result: PrefillResult) -> None:
        """Apply `batch`'s result (the one place a prefill batch's outcome lands): a chunk that does not
        end its prompt queues its next one first; the prompts that ended are completed."""
        self.running = None
        ended = [index for index, line in enumerate(batch.lines) if line.last]
        going_on: list[ServingRequest] = []
        for index, (item, line) in enumerate(zip(batch.items, batch.lines, strict=True)):
            if line.last:
                continue
            request = item.request  # a chunk that does not end its prompt: its next one runs first
            if result.prompt_logprobs is not None and (scored := result.prompt_logprobs[index]) is not None:
                request.prompt_scored(scored)
            request.prefilled_to(line.stop)
            self._tables[request.request_id] = item.table
            going_on.append(request)
        self.queue.push_front(going_on)
        if len(ended) < len(batch.items):
            self._changed()  # queued prompt tokens changed
            result = _rows(result, ended)
        if ended:
            self.complete([batch.items[index] for index in ended], result)

    def _refused(self, batch: Batch, error: ModelInputError) -> None:
        self.running = None
        refuse(list(batch.items), code="bad_request", message=str(error), release=self.release)

    def complete(self, batch: list[Held], result: PrefillResult) -> None:
        """The prompts of `batch` ran through the head: apply their first tokens (and the prompts' and
        first tokens' log-probabilities, where asked); the requests that go on queue their KV for a
        decode replica (also for relayed and finished ZigZag batches). A prompt that looked the prefix
        cache up puts its computed blocks there now: later prompts may borrow them while it migrates."""
        assert result.tokens is not None  # every layer and the head ran
        for item in batch:
            self._kv.prefix.publish(item.request.request_id, item.table)
        if result.prompt_logprobs is not None:
            for item, scored in zip(batch, result.prompt_logprobs, strict=True):
                if scored is not None:
                    item.request.prompt_scored(scored)
        going_on = apply_tokens(
            batch,
            result.tokens,
            context_length=self._compute.context_length,
            release=self.release,
            log=self._actor.log,
            first=True,
            logprobs=result.logprobs,
        )
        for item in going_on:
            self._migrate(item)

    def release(self, item: Held) -> None:
        """`item` ended here: its blocks go back (borrowed ones to the prefix cache); a relayed request's
        partner frees the KV of layers `[0, n)` it keeps (the request's end does too, where the partner
        sees it; this says so)."""
        self._kv.release(item.table, item.request.request_id)
        item.request.released_blocks()
        relay = item.relay
        if relay is not None and relay.layer > 0:
            drop = DropKVHalf(command_id=new_command_id(), request_id=item.request.request_id)
            tell_peer(self._actor, self._directory, relay.new_prefill, drop)  # of this node or another


def _sequence(item: Held, chunk: Line) -> PrefillSequence:
    """The prefill call's sequence for `chunk` of `item`'s prompt: its tokens from `chunk.start` on,
    over the KV of the tokens before (already in the blocks); the first token is sampled, and scored,
    only by the chunk that ends the prompt."""
    request = item.request
    start, stop = chunk.start, chunk.stop
    whole = start == 0 and chunk.last
    embeds, indices = request.embeds, request.embed_indices
    if not whole and embeds is not None and indices is not None:
        inside = (indices >= start) & (indices < stop)
        embeds, indices = embeds[inside], indices[inside] - start
        if not len(indices):
            embeds = indices = None
    positions = request.positions
    return PrefillSequence(
        block_table=item.table,
        token_ids=request.token_ids if whole else request.token_ids[start:stop],
        cached_tokens=start,
        positions=positions if positions is None or whole else positions[start:stop],
        embeds=embeds,
        embed_indices=indices,
        sampling=request.sampling,
        logprobs=request.logprobs if chunk.last else None,
        prompt_logprobs=request.prompt_logprobs,
        next_token=None if chunk.last else request.token_ids[stop],
        # Every chunk samples a token (a chunk that does not end its prompt drops it), so each carries the
        # history its penalties read.
        history=token_history(request.sampling, request.token_ids, request.generated),
    )


def _rows(result: PrefillResult, rows: list[int]) -> PrefillResult:
    """`result` for the batch's sequences `rows` only (those whose chunk ended their prompt)."""
    picked = torch.tensor(rows, dtype=torch.int64)
    logits = None if result.logits is None else result.logits.index_select(0, picked.to(result.logits.device))
    tokens, logprobs, prompt = result.tokens, result.logprobs, result.prompt_logprobs
    return dataclasses.replace(
        result,
        logits=logits,
        tokens=None if tokens is None else [tokens[row] for row in rows],
        logprobs=None if logprobs is None else [logprobs[row] for row in rows],
        prompt_logprobs=None if prompt is None else [prompt[row] for row in rows],
    )
