"""The language side of the embedding transfer, inside a prefill replica (architecture §5, docs/epd.md).

As soon as a prefill replica takes an image request (`start`), a helper task connects to the encode
replica the router chose and receives the transfer in the transport's owned, consumed mode: the
default grant goes out at once, before anyone here knows the length; REQUEST_MORE_CACHE rounds follow
as the sender's total requires, within the per-round cap; each landed round is copied into the
request's input by an `EmbeddingAssembler` and its blocks go back to the pool. When the transfer
ends, the main loop (`_landed`) lays out the prompt with the header's grids — the request becomes
ready for prefill — or fails the request with the transfer's error code. A replica that left the
states that keep image requests meanwhile (`replicas.states.KEEPS_IMAGE_REQUESTS`) gives the ready
request back to the router.

Cancellation: `ServingRequest.cancel` cancels the receive (the transport aborts and returns or
quarantines the blocks); the request is then finished `cancelled` by `_landed`. When the replica
stops, its nursery cancels the receive the same way and the supervisor fails the request.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import final

from messages.control import ErrorCode
from messages.control_replies import TransferSummary
from messages.log.events import TransferFinished, TransferRound, TransferStarted
from replicas.embedding import EmbeddedPrompt, EmbeddingAssembler, EmbeddingMismatch, PromptTooLong
from replicas.fabric import Fabric, UnknownEndpoint
from replicas.faults import FaultHooks
from replicas.ports import Actor
from replicas.prefill.queue import PromptQueue
from replicas.request import EmbeddingRoute, ServingRequest
from replicas.settings import ReplicaSettings
from replicas.states import KEEPS_IMAGE_REQUESTS
from transport.endpoint import TransferEndpoint
from transport.errors import HandshakeRefused, LinkError, TransferError
from transport.protocol.landing import LandedRound

ReceiveFailure = (
    TransferError | LinkError | HandshakeRefused | UnknownEndpoint | EmbeddingMismatch | PromptTooLong
)
_transfer_numbers = itertools.count(1)


def new_embedding_transfer_id(request_id: str) -> str:
    """A transfer id unique in this process (a reused request id must not meet an old transfer)."""
    return f"{request_id}/emb{next(_transfer_numbers)}"


def encode_endpoint_name(encoder: str) -> str:
    return f"{encoder}/emb"


@final
class EmbeddingReceives:
    """The embedding receives of one prefill replica (see the module docstring), landing in its
    `endpoint`'s pool; the requests wait in its `queue`. `returned` gives a request back to the router,
    `changed` tells the node the replica's readiness changed."""

    def __init__(
        self,
        actor: Actor,
        *,
        endpoint: TransferEndpoint,
        fabric: Fabric,
        image_token_id: int,
        context_length: int,
        settings: ReplicaSettings,
        faults: FaultHooks,
        queue: PromptQueue,
        returned: Callable[[ServingRequest], None],
        changed: Callable[[], None],
    ) -> None:
        self._actor = actor
        self._endpoint = endpoint
        self._fabric = fabric
        self._image_token_id = image_token_id
        self._context_length = context_length
        self._settings = settings
        self._faults = faults
        self._queue = queue
        self._returned = returned
        self._changed = changed
        self.active: dict[str, ServingRequest] = {}

    def receiving(self, request: ServingRequest) -> bool:
        return request.request_id in self.active

    def start(self, request: ServingRequest) -> None:
        """Begin receiving `request`'s embeddings (called when the replica enqueues it)."""
        route = request.embedding_route
        if route is None:
            self._drop(request)
            request.fail(
                "internal",
                f"request {request.request_id} cannot receive its image embeddings: "
                "no encode replica was assigned",
            )
            return
        self.active[request.request_id] = request
        self._actor.spawn(self._receive, request, route)

    async def _receive(self, request: ServingRequest, route: EmbeddingRoute) -> None:
        replica = self._actor
        endpoint = self._endpoint
        image_token_id = self._image_token_id
        log = replica.log.bind(request_id=request.request_id)
        transport = self._fabric.kind
        bytes_per_token = endpoint.storage.layout.bytes_per_token
        log.emit(
            TransferStarted(
                kind="embedding",
                transfer_id=route.transfer_id,
                source=route.encoder,
                destination=replica.name,
                transport=transport,
                total_tokens=None,
                granted_blocks=endpoint.config.default_grant_blocks,
            )
        )

        def on_round(landed: LandedRound) -> None:
            if landed.tokens:
                log.emit(
                    TransferRound(
                        kind="embedding",
                        transfer_id=route.transfer_id,
                        round=landed.round,
                        offset=landed.offset,
                        tokens=landed.tokens,
                        total_tokens=landed.total_tokens,
                        bytes=landed.tokens * bytes_per_token,
                        source=route.encoder,
                        destination=replica.name,
                        transport=transport,
                    )
                )

        assembler = EmbeddingAssembler(
            request.request_id,
            request.prompt_ids,
            image_token_id,
            max_tokens=self._context_length,
            on_round=on_round,
        )
        started = time.time()
        failure: ReceiveFailure | None = None

        def finished(ended: float, reason: str | None) -> float:
            """Log the transfer's end (`reason` None: success); returns its seconds: from the sender
            starting to send (stamped by the encode side) to the last round consumed here — the wait for
            the encoder before it is not the transfer's."""
            seconds = max(0.0, ended - (request.stamps.embedding_started or started))
            log.emit(
                TransferFinished(
                    kind="embedding",
                    transfer_id=route.transfer_id,
                    status="success" if reason is None else "failed",
                    reason=reason,
                    rounds=assembler.rounds,
                    tokens=assembler.filled,
                    bytes=assembler.filled * bytes_per_token,
                    seconds=seconds,
                    source=route.encoder,
                    destination=replica.name,
                    transport=transport,
                )
            )
            return seconds

        try:
            with request.work_scope() as scope:  # also when its encode side failed the request
                try:
                    link = await self._fabric.link(endpoint, encode_endpoint_name(route.encoder))
                    await endpoint.receive(route.transfer_id, peer=link, consume=assembler.consume)
                except (
                    TransferError,
                    LinkError,
                    HandshakeRefused,
                    UnknownEndpoint,
                    EmbeddingMismatch,
                    PromptTooLong,
                ) as exc:
                    failure = exc
        except BaseException:  # the replica stops (fails, shuts down; Cancelled, often in a group): the
            # log still ends the transfer; the exception goes on
            finished(time.time(), "aborted")
            raise
        ended = time.time()
        succeeded = failure is None and not scope.cancelled_caught
        seconds = finished(ended, None if succeeded else (_reason(failure) or "aborted"))
        self._fabric.count_bytes(route.encoder, replica.name, "embedding", assembler.filled * bytes_per_token)
        summary = TransferSummary(
            kind="embedding",
            transfer_id=route.transfer_id,
            source=route.encoder,
            destination=replica.name,
            rounds=assembler.rounds,
            bytes=assembler.filled * bytes_per_token,
            seconds=seconds,
            transport=transport,
        )
        replica.later(lambda: self._landed(request, assembler, summary, failure, ended))

    def _landed(
        self,
        request: ServingRequest,
        assembler: EmbeddingAssembler,
        summary: TransferSummary,
        failure: ReceiveFailure | None,
        ended: float,
    ) -> None:
        """Main loop: the receive ended; the request becomes ready for prefill, or it ends here."""
        self.active.pop(request.request_id, None)
        if request.ended or request.cancelled or failure is not None:
            self._drop(request)
            if request.cancelled:
                request.finish("cancelled")  # no-op when it already ended
            elif failure is not None:
                request.fail(*_failure(request, summary, failure))
            return
        try:
            prompt = assembler.finish()
        except EmbeddingMismatch as exc:
            self._drop(request)
            request.fail("transfer_failed", f"embedding transfer {summary.transfer_id}: {exc}")
            return
        refusal = self._refusal(request, prompt)
        if refusal is not None:
            self._drop(request)
            request.fail("bad_request", refusal)
            return
        self._faults.corrupt_landed_embeddings(
            self._actor.log.bind(request_id=request.request_id), prompt.embeds, replica=self._actor.name
        )
        self._give(request, prompt, summary, ended)
        if self._actor.state not in KEEPS_IMAGE_REQUESTS:  # e.g. becoming a decode replica meanwhile
            self._drop(request, keep_input=True)
            request.hand_to(None)
            self._returned(request)
            self._changed()

    def _give(
        self, request: ServingRequest, prompt: EmbeddedPrompt, summary: TransferSummary, ended: float
    ) -> None:
        """The request's input is complete: it is ready for prefill."""
        request.laid_out(prompt)
        request.stamp_first("embedding_started", ended - summary.seconds)
        request.stamp("embedding_finished", ended)
        request.transfers.append(summary)

    def _refusal(self, request: ServingRequest, prompt: EmbeddedPrompt) -> str | None:
        """Why the laid-out prompt cannot be served (its length was unknown at admission)."""
        context = self._context_length
        tokens = len(prompt.token_ids)
        if tokens >= context:
            return (
                f"prompt of {tokens} tokens with its image rows does not fit the context of {context} "
                "tokens (it must leave room for one generated token)"
            )
        settings = self._settings
        capacity = min(tokens + request.max_tokens - 1, context)
        blocks = -(-capacity // settings.kv_block_size)
        if blocks > settings.kv_pool_blocks:
            return (
                f"prompt ({tokens} tokens with its image rows) + max_tokens ({request.max_tokens}) needs "
                f"{blocks} KV blocks, but a replica's KV pool has {settings.kv_pool_blocks}"
            )
        return None

    def _drop(self, request: ServingRequest, *, keep_input: bool = False) -> None:
        """Take `request` out of the prefill queue (and forget its input unless kept)."""
        if request in self._queue:
            self._queue.remove(request)
        if not keep_input:
            release_input(request)


def release_input(request: ServingRequest) -> None:
    """Forget a request's assembled embedding rows (they live in host tensors, not in pool blocks)."""
    request.drop_embeddings()


def _reason(failure: ReceiveFailure | None) -> str | None:
    match failure:
        case None:
            return None
        case TransferError():
            return failure.reason.value
        case EmbeddingMismatch():
            return "protocol_error"
        case PromptTooLong():
            return "too_large"
        case _:
            return "link_lost"


def _failure(
    request: ServingRequest, summary: TransferSummary, failure: ReceiveFailure
) -> tuple[ErrorCode, str]:
    what = f"embedding transfer {summary.transfer_id} of request {request.request_id} from {summary.source}"
    match failure:
        case TransferError():
            return failure.code, f"{what} failed: {failure}"
        case PromptTooLong():
            return "bad_request", str(failure)
        case _:
            return "transfer_failed", f"{what} failed: {failure}"
