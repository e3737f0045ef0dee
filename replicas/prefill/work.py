"""Prefill behaviour: batch the work queue within a block budget, run the prompt, sample the first token.

A batch takes ready requests first come, first served, until `max_batch_size` sequences or
`max_batch_tokens` prompt tokens (a longer prompt runs alone) or the KV pool has no room for the next
prompt. Requests still waiting for their image embeddings are skipped, not waited for. After the
prompt runs, each request's first token is streamed; finished requests free their blocks, the others
go to the migrator, which moves their KV to a decode replica.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, final

from messages.control_replies import RelayInfo
from messages.log.events import FirstToken, PrefillFinished, PrefillStarted
from replicas.model import ModelInputError, PrefillResult, PrefillSequence, finish_reason
from replicas.request import ServingRequest

if TYPE_CHECKING:
    from replicas.actor import Replica
    from replicas.roles import RoleWork


@final
@dataclass(frozen=True, slots=True)
class Prefilled:
    """A request whose prompt KV sits in this replica's blocks `table` (owner: the request id).

    `relay`: set when the prefill was relayed to this replica (ZigZag): it computed the KV of layers
    `[relay.layer, L)`, and `relay.new_prefill` holds `[0, relay.layer)`."""

    request: ServingRequest
    table: list[int]
    relay: RelayInfo | None = None


@final
class PrefillWork:
    """The prefill role of one replica (see the module docstring)."""

    def __init__(self, work: RoleWork) -> None:
        self.work = work
        self.queue: deque[ServingRequest] = deque()
        self.running: list[Prefilled] = []

    @property
    def _replica(self) -> Replica:
        return self.work.replica

    def enqueue(self, request: ServingRequest) -> None:
        request.holder = self._replica.name
        self.queue.append(request)
        if request.needs_embeddings:
            self.work.encode.start_receiving(request)

    def return_queued(self, why: str) -> None:
        """Give queued requests whose prompt has not started back to the router (state change)."""
        services = self._replica.services
        keep: deque[ServingRequest] = deque()
        for request in self.queue:
            if request.has_images and not request.prompt_ready:
                keep.append(request)  # its embeddings are landing here; finish receiving first
                continue
            request.holder = None
            services.return_work(request)
        self.queue = keep

    def cancel_sweep(self) -> None:
        """Finish queued requests that were cancelled (their embedding transfers end on their own)."""
        if any(request.cancelled for request in self.queue):
            for request in [r for r in self.queue if r.cancelled and not self.work.encode.receiving(r)]:
                self.queue.remove(request)
                self.work.encode.release(request)
                request.finish("cancelled")

    # ------------------------------------------------------------------ a batch
    def start_batch(self) -> None:
        executor = self.work.executor
        if executor is None or not self.queue:
            return
        taken = self.take_batch()
        if taken is None:
            return
        batch, sequences = taken
        self.running = batch
        tokens = sum(item.request.prompt_tokens for item in batch)
        layers = self._replica.services.host.config.num_layers
        emulated = self.work.emulated_prefill(tokens, layers)
        self.work.compute(lambda: executor.prefill(sequences), self._finished, emulated=emulated)

    def take_batch(self) -> tuple[list[Prefilled], list[PrefillSequence]] | None:
        """Take the next batch off the queue (see the module docstring), its KV blocks allocated, its
        requests stamped and logged as started; None when no request is ready or the first does not fit."""
        kv = self._replica.pools.kv
        assert kv is not None
        settings = self._replica.services.settings
        batch: list[Prefilled] = []
        tokens = 0
        for request in list(self.queue):
            if not request.prompt_ready or request.cancelled:
                continue
            if batch and (
                len(batch) >= settings.max_batch_size
                or tokens + request.prompt_tokens > settings.max_batch_tokens
            ):
                break
            table = kv.pool.try_allocate(kv.blocks_for(request.prompt_tokens), request.request_id)
            if table is None:
                break  # first come, first served: no overtaking the one that does not fit
            self.queue.remove(request)
            batch.append(Prefilled(request, table))
            tokens += request.prompt_tokens
        if not batch:
            return None
        self._replica.services.readiness_changed()  # room in the queue: the router may hand more
        now = time.time()
        sequences = []
        eos = tuple(self.work.model.eos_token_ids) if self.work.model is not None else ()
        for item in batch:
            request = item.request
            request.eos_token_ids = eos
            request.stamps.prefill_started = now
            self._replica.log.bind(request_id=request.request_id).emit(
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
                )
            )
        return batch, sequences

    def _finished(self, result: PrefillResult | ModelInputError) -> None:
        batch, self.running = self.running, []
        kv = self._replica.pools.kv
        assert kv is not None
        if isinstance(result, ModelInputError):
            for item in batch:
                kv.pool.free(item.table, item.request.request_id)
                item.request.fail("bad_request", str(result))
            return
        assert result.tokens is not None
        self.complete(batch, result.tokens)

    def complete(self, batch: list[Prefilled], tokens: list[int]) -> None:
        """The prompts of `batch` ran through the head: stream each first token, then end the request
        or queue its KV for a decode replica (also for relayed and locally finished ZigZag batches)."""
        kv = self._replica.pools.kv
        assert kv is not None
        now = time.time()
        for item, token in zip(batch, tokens, strict=True):
            request = item.request
            log = self._replica.log.bind(request_id=request.request_id)
            request.stamps.prefill_finished = now
            log.emit(
                PrefillFinished(
                    tokens=request.prompt_tokens, seconds=now - (request.stamps.prefill_started or now)
                )
            )
            if request.cancelled:
                self.work.old_prefill.release_half(item)
                kv.pool.free(item.table, request.request_id)
                request.finish("cancelled")
                continue
            request.generated.append(token)
            request.emit_tokens([token])
            log.emit(FirstToken(token_id=token, ttft_s=now - request.stamps.arrived))
            reason = finish_reason(
                request.generated, request.sampling, request.eos_token_ids, request.max_tokens
            )
            if reason is None and request.context_tokens + 1 > self.work.context_length:
                reason = "length"
            if reason is not None:
                self.work.old_prefill.release_half(item)
                kv.pool.free(item.table, request.request_id)
                request.finish(reason)
                continue
            self.work.migrator.enqueue(item)
