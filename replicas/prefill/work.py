"""Prefill behaviour: batch the work queue within a block budget, run the prompt, sample the first token.

Plan → execute → apply: `start_batch` takes the batch `replicas.prefill.queue.schedule` chose (its KV
blocks allocated, its requests stamped and logged), the prompts run through every layer and the head in
a worker thread (`replicas.step.compute`), and `complete` applies the first tokens
(`replicas.step.apply.apply_tokens`): each streamed; finished requests free their blocks, the others go
to the migration queue, which moves their KV to a decode replica. A batch the model refuses fails its
requests with `bad_request`.

Image requests: enqueued, they start receiving their embeddings at once (`replicas.prefill.embeddings`);
the schedule skips them until the prompt is laid out. A request whose KV partly lives on a ZigZag
partner (`Held.relay`) has that half dropped there when it ends here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import final

from messages.commands import DropKVHalf
from messages.log.events import PrefillStarted
from replicas.inbox import new_command_id
from replicas.model import KVCache, ModelInputError, PrefillResult, PrefillSequence
from replicas.ports import Actor, Directory
from replicas.prefill.embeddings import EmbeddingReceives, release_input
from replicas.prefill.queue import PromptQueue, schedule
from replicas.request import ServingRequest
from replicas.settings import ReplicaSettings
from replicas.step.apply import apply_tokens, refuse
from replicas.step.compute import Compute
from replicas.step.plan import Held, PrefillCall


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
    ) -> None:
        self._actor = actor
        self.queue = queue
        self._kv = kv
        self._settings = settings
        self._compute = compute
        self._embeddings = embeddings
        self._directory = directory
        self._migrate = migrate
        self._returned = returned
        self._changed = changed
        self.running: list[Held] = []

    def enqueue(self, request: ServingRequest) -> None:
        request.holder = self._actor.name
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

    def return_queued(self, why: str) -> None:
        """Give queued requests whose prompt has not started back to the router (state change)."""
        for request in self.queue.take_all():
            if request.has_images and not request.prompt_ready:
                self.queue.append(request)  # its embeddings are landing here; finish receiving first
                continue
            request.holder = None
            self._returned(request)

    def cancel_sweep(self) -> None:
        """Finish queued requests that were cancelled (their embedding transfers end on their own)."""
        receiving = self._embeddings.receiving if self._embeddings is not None else lambda _: False
        for request in [r for r in self.queue if r.cancelled and not receiving(r)]:
            self.queue.remove(request)
            release_input(request)
            request.finish("cancelled")

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
        tokens = sum(item.request.prompt_tokens for item in batch)
        call = PrefillCall(sequences)
        self._compute.run(
            lambda: call.run(executor),
            self._finished,
            self._refused,
            emulated=self._compute.emulated_prefill(tokens, self._compute.num_layers),
        )

    def take_batch(self) -> tuple[list[Held], list[PrefillSequence]] | None:
        """Take the scheduled batch off the queue, its KV blocks allocated, its requests stamped and
        logged as started; None when no request is ready or the first does not fit."""
        kv, settings = self._kv, self._settings
        planned = schedule(
            self.queue,
            free_blocks=kv.pool.free_blocks,
            blocks_for=kv.blocks_for,
            max_batch_size=settings.max_batch_size,
            max_batch_tokens=settings.max_batch_tokens,
        )
        batch: list[Held] = []
        for request in planned:
            table = kv.pool.try_allocate(kv.blocks_for(request.prompt_tokens), request.request_id)
            if table is None:
                break  # the allocator refused (a waiter is queued): the rest waits its turn
            self.queue.remove(request)
            batch.append(Held(request, table))
        if not batch:
            return None
        self._changed()  # room in the queue: the router may hand more
        now = time.time()
        model = self._compute.model
        eos = tuple(model.eos_token_ids) if model is not None else ()
        sequences = []
        for item in batch:
            request = item.request
            request.eos_token_ids = eos
            request.stamps.prefill_started = now
            self._actor.log.bind(request_id=request.request_id).emit(
                PrefillStarted(tokens=request.prompt_tokens, batch_size=len(batch))
            )
            sequences.append(
                PrefillSequence(
                    block_table=item.table,
                    token_ids=request.token_ids,
                    positions=request.positions,
                    embeds=request.embeds,
                    embed_indices=request.embed_indices,
                    sampling=request.sampling,
                    logprobs=request.logprobs,
                    prompt_logprobs=request.prompt_logprobs,
                )
            )
        return batch, sequences

    def _finished(self, result: PrefillResult) -> None:
        batch, self.running = self.running, []
        self.complete(batch, result)

    def _refused(self, error: ModelInputError) -> None:
        batch, self.running = self.running, []
        refuse(batch, code="bad_request", message=str(error), release=self.release)

    def complete(self, batch: list[Held], result: PrefillResult) -> None:
        """The prompts of `batch` ran through the head: apply their first tokens (and the prompts' and
        first tokens' log-probabilities, where asked); the requests that go on queue their KV for a
        decode replica (also for relayed and finished ZigZag batches)."""
        assert result.tokens is not None  # every layer and the head ran
        if result.prompt_logprobs is not None:
            for item, scored in zip(batch, result.prompt_logprobs, strict=True):
                if scored is not None:
                    item.request.prompt_scores = [None, *scored]
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
        """`item` ended here: its blocks go back; a relayed request's partner frees the KV of layers
        `[0, n)` it keeps (the request's end does too, where the partner sees it; this says so)."""
        self._kv.pool.free(item.table, item.request.request_id)
        relay = item.relay
        if relay is not None and relay.layer > 0:
            partner = self._directory.get(relay.new_prefill)
            if partner is not None:
                partner.tell(DropKVHalf(command_id=new_command_id(), request_id=item.request.request_id))
