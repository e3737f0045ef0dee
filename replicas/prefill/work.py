"""Prefill behaviour: batch the work queue within a block budget, run the prompt, sample the first token.

Plan → execute → apply: `start_batch` takes the batch `replicas.prefill.queue.schedule` chose (its KV
blocks allocated, its requests stamped and logged), the prompts run through every layer and the head in
a worker thread (`replicas.step.compute`), and `complete` applies the first tokens
(`replicas.step.apply.apply_tokens`): each streamed; finished requests free their blocks, the others go
to the migration queue, which moves their KV to a decode replica. A batch the model refuses fails its
requests with `bad_request`.

Chunked prefill (`ReplicaSettings.chunk_tokens`): `replicas.prefill.queue.schedule` cuts a long prompt
into chunks; a batch runs each chunk from its start position over the KV of the chunks before it (in
the request's blocks, allocated with the first chunk and kept in `_tables` between chunks); a chunk
that does not end its prompt samples nothing — its request goes back to the front of the queue, its
next chunk first in the next batch — and the one that does is applied like a whole prompt. The KV moves to the decode replica once the
whole prompt ran (not chunk by chunk).

Image requests: enqueued, they start receiving their embeddings at once (`replicas.prefill.embeddings`);
the schedule skips them until the prompt is laid out. A request whose KV partly lives on a ZigZag
partner (`Held.relay`) has that half dropped there when it ends here.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import final

import torch

from messages.commands import DropKVHalf
from messages.log.events import PrefillStarted
from replicas.inbox import new_command_id
from replicas.model import KVCache, ModelInputError, PrefillResult, PrefillSequence, token_history
from replicas.ports import Actor, Directory, tell_peer
from replicas.prefill.embeddings import EmbeddingReceives, release_input
from replicas.prefill.prefix import PrefixLookup
from replicas.prefill.pull import Puller
from replicas.prefill.queue import Chunk, PromptQueue, schedule
from replicas.request import ServingRequest
from replicas.settings import ReplicaSettings
from replicas.states import KEEPS_IMAGE_REQUESTS, ReplicaState
from replicas.step.apply import apply_tokens, refuse
from replicas.step.compute import Compute
from replicas.step.grammar import grammar_rows
from replicas.step.plan import Held, PrefillCall

S = ReplicaState


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
        self.running: list[Held] = []
        self._chunks: list[Chunk] = []  # the running batch's, item for item
        self._tables: dict[str, list[int]] = {}  # the blocks of queued requests whose first chunks ran

    @property
    def running_tokens(self) -> int:
        """The prompt tokens of the batch computing now (0: none)."""
        return sum(chunk.tokens for chunk in self._chunks)

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
        request.prefilled = 0
        request.prompt_scores = []

    # ------------------------------------------------------------------ a batch
    def start_batch(self) -> None:
        """Plan, execute and apply the next batch (main loop, no compute running)."""
        executor = self._compute.executor
        if executor is None or not self.queue:
            return
        taken = self.take_batch()
        if taken is None:
            return
        batch, sequences = taken
        self.running = batch
        tokens = sum(sequence.num_tokens for sequence in sequences)
        grammars = grammar_rows([item.request for item in batch], [chunk.last for chunk in self._chunks])
        call = PrefillCall(sequences, grammars=grammars)
        self._compute.run(
            lambda: call.run(executor),
            self._finished,
            self._refused,
            emulated=self._compute.emulated_prefill(tokens, self._compute.num_layers),
        )

    def take_batch(
        self, *, chunked: bool = True, cached: bool = True
    ) -> tuple[list[Held], list[PrefillSequence]] | None:
        """Take the scheduled batch off the queue, its KV blocks allocated — a new prompt's cached prefix
        borrowed from the prefix cache (`cached`: a batch that runs every layer here; not for a prompt
        whose log-probabilities are asked), its first chunk then starting after it —, its requests
        stamped and logged as started; None when no request is ready or the first does not fit.
        `chunked` false: whole prompts (a ZigZag batch)."""
        kv, settings, model = self._kv, self._settings, self._compute.model
        planned = schedule(
            self.queue,
            free_blocks=kv.pool.available_blocks,
            blocks_for=kv.blocks_for,
            max_batch_size=settings.max_batch_size,
            max_batch_tokens=settings.max_batch_tokens,
            chunk_tokens=settings.chunk_tokens if chunked else None,
        )
        batch: list[Held] = []
        chunks: list[Chunk] = []
        starting: set[str] = set()
        for chunk in planned:
            request = chunk.request
            table = self._tables.pop(request.request_id, None)
            if table is None:
                lookup = cached and model is not None
                # A prompt that scores its tokens runs every row: it borrows nothing (its blocks still
                # join the cache, so later prompts — the other choices of its body — borrow them).
                scored = request.prompt_logprobs is not None
                pulled = self._puller.take(request.request_id) if self._puller is not None else None
                if pulled is not None and (not lookup or scored):  # a batch that borrows nothing (ZigZag)
                    self._kv.release(pulled[0], request.request_id)
                    pulled = None
                if pulled is not None:  # its prefix is borrowed already (pulled, or its own)
                    borrowed, source = pulled
                else:
                    borrowed = (
                        self._prefix.borrow(request, model, share=not scored)
                        if lookup and model is not None
                        else []
                    )
                    source = None
                table = kv.pool.try_allocate(
                    kv.blocks_for(request.prompt_tokens) - len(borrowed), request.request_id
                )
                if table is None:  # the allocator refused (a waiter is queued): the rest waits its turn
                    self._kv.release(borrowed, request.request_id)
                    break
                table = borrowed + table
                request.cached_tokens = request.prefilled = len(borrowed) * kv.block_size
                request.cached_from = (source or "local") if borrowed else None
                if lookup and not scored:
                    self._prefix.counted(request, request.cached_tokens)
                if borrowed:  # the chunk starts after the borrowed prefix, as long as planned
                    stop = min(request.prompt_tokens, request.prefilled + chunk.tokens)
                    chunk = Chunk(request, request.prefilled, stop)
                starting.add(request.request_id)
            self.queue.remove(request)
            batch.append(Held(request, table))
            chunks.append(chunk)
        if not batch:
            return None
        self._chunks = chunks
        self._changed()  # room in the queue: the router may hand more
        now = time.time()
        eos = tuple(model.eos_token_ids) if model is not None else ()
        sequences = []
        for item, chunk in zip(batch, chunks, strict=True):
            request = item.request
            if request.request_id in starting:
                request.eos_token_ids = eos
                request.stamps.prefill_started = now
                self._actor.log.bind(request_id=request.request_id).emit(
                    PrefillStarted(
                        tokens=request.prompt_tokens,
                        batch_size=len(batch),
                        cached_tokens=request.cached_tokens,
                        cached_from=request.cached_from,
                    )
                )
            sequences.append(_sequence(item, chunk))
        return batch, sequences

    def _finished(self, result: PrefillResult) -> None:
        batch, self.running = self.running, []
        chunks, self._chunks = self._chunks, []
        ended = [index for index, chunk in enumerate(chunks) if chunk.last]
        going_on: list[ServingRequest] = []
        for index, (item, chunk) in enumerate(zip(batch, chunks, strict=True)):
            if chunk.last:
                continue
            request = item.request  # a chunk that does not end its prompt: its next one runs first
            if result.prompt_logprobs is not None and (scored := result.prompt_logprobs[index]) is not None:
                request.prompt_scores = [*(request.prompt_scores or [None]), *scored]
            request.prefilled = chunk.stop
            self._tables[request.request_id] = item.table
            going_on.append(request)
        self.queue.push_front(going_on)
        if len(ended) < len(batch):
            self._changed()  # queued prompt tokens changed
            result = _rows(result, ended)
        if ended:
            self.complete([batch[index] for index in ended], result)

    def _refused(self, error: ModelInputError) -> None:
        batch, self.running = self.running, []
        self._chunks = []
        refuse(batch, code="bad_request", message=str(error), release=self.release)

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
                    item.request.prompt_scores = [*(item.request.prompt_scores or [None]), *scored]
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
        item.request.prefilled = 0
        relay = item.relay
        if relay is not None and relay.layer > 0:
            drop = DropKVHalf(command_id=new_command_id(), request_id=item.request.request_id)
            tell_peer(self._actor, self._directory, relay.new_prefill, drop)  # of this node or another


def _sequence(item: Held, chunk: Chunk) -> PrefillSequence:
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
