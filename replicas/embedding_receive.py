"""The language side of the embedding transfer, inside a prefill replica (architecture §5, docs/epd.md).

As soon as a prefill replica takes an image request (`start`), a helper task connects to the encode
replica the router chose and receives the transfer in the transport's owned, consumed mode: the
default grant goes out at once, before anyone here knows the length; REQUEST_MORE_CACHE rounds follow
as the sender's total requires, within the per-round cap; each landed round is copied into the
request's input by an `EmbeddingAssembler` and its blocks go back to the pool. When the transfer
ends, the main loop (`_landed`) lays out the prompt with the header's grids — the request becomes
ready for prefill — or fails the request with the transfer's error code.

Cancellation: `ServingRequest.cancel` cancels the receive (the transport aborts and returns or
quarantines the blocks); the request is then finished `cancelled` by `_landed`. When the replica
stops, its nursery cancels the receive the same way and the supervisor fails the request.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, final

from messages.control import ErrorCode
from messages.control_replies import TransferSummary
from messages.faults import CorruptTransfer
from messages.log.events import FaultInjected, TransferFinished, TransferRound, TransferStarted
from replicas.embedding import EmbeddedPrompt, EmbeddingAssembler, EmbeddingMismatch, PromptTooLong
from replicas.fabric import UnknownEndpoint
from replicas.inbox import Completed
from replicas.request import EmbeddingRoute, ServingRequest
from replicas.states import KEEPS_IMAGE_REQUESTS
from transport.errors import HandshakeRefused, LinkError, TransferError
from transport.protocol.landing import LandedRound

if TYPE_CHECKING:
    from replicas.roles import RoleWork

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
    """The embedding receives of one prefill replica (see the module docstring)."""

    def __init__(self, work: RoleWork) -> None:
        self.work = work
        self.active: dict[str, ServingRequest] = {}

    def receiving(self, request: ServingRequest) -> bool:
        return request.request_id in self.active

    def start(self, request: ServingRequest) -> None:
        """Begin receiving `request`'s embeddings (called when the replica enqueues it)."""
        replica = self.work.replica
        route = request.embedding_route
        if route is None or replica.pools.emb_endpoint is None:
            why = (
                "no encode replica was assigned" if route is None else f"{replica.name} has no embedding pool"
            )
            self._drop(request)
            request.fail(
                "internal", f"request {request.request_id} cannot receive its image embeddings: {why}"
            )
            return
        self.active[request.request_id] = request
        self.work.spawn(self._receive, request, route)

    async def _receive(self, request: ServingRequest, route: EmbeddingRoute) -> None:
        replica = self.work.replica
        services = replica.services
        endpoint = replica.pools.emb_endpoint
        assert endpoint is not None
        image_token_id = services.host.config.image_token_id
        assert image_token_id is not None
        log = replica.log.bind(request_id=request.request_id)
        transport = services.fabric.kind
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
            max_tokens=self.work.context_length,
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
                    link = await services.fabric.link(endpoint, encode_endpoint_name(route.encoder))
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
        services.fabric.count_bytes(
            route.encoder, replica.name, "embedding", assembler.filled * bytes_per_token
        )
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
        replica.post(Completed(lambda _: self._landed(request, assembler, summary, failure, ended)))

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
        self._maybe_corrupt(request, prompt)
        self._give(request, prompt, summary, ended)
        if self.work.replica.state not in KEEPS_IMAGE_REQUESTS:  # e.g. becoming a decode replica meanwhile
            self._drop(request, keep_input=True)
            request.holder = None
            self.work.replica.services.return_work(request)
            self.work.replica.services.readiness_changed()

    def _give(
        self, request: ServingRequest, prompt: EmbeddedPrompt, summary: TransferSummary, ended: float
    ) -> None:
        """The request's input is complete: it is ready for prefill."""
        request.token_ids = prompt.token_ids
        request.positions = prompt.positions
        request.next_position = prompt.next_position
        request.embeds = prompt.embeds
        request.embed_indices = prompt.embed_indices
        request.image_grids = prompt.grids
        request.stamps.embedding_started = request.stamps.embedding_started or (ended - summary.seconds)
        request.stamps.embedding_finished = ended
        request.transfers.append(summary)

    def _refusal(self, request: ServingRequest, prompt: EmbeddedPrompt) -> str | None:
        """Why the laid-out prompt cannot be served (its length was unknown at admission)."""
        context = self.work.context_length
        tokens = len(prompt.token_ids)
        if tokens >= context:
            return (
                f"prompt of {tokens} tokens with its image rows does not fit the context of {context} "
                "tokens (it must leave room for one generated token)"
            )
        settings = self.work.replica.services.settings
        capacity = min(tokens + request.max_tokens - 1, context)
        blocks = -(-capacity // settings.kv_block_size)
        if blocks > settings.kv_pool_blocks:
            return (
                f"prompt ({tokens} tokens with its image rows) + max_tokens ({request.max_tokens}) needs "
                f"{blocks} KV blocks, but a replica's KV pool has {settings.kv_pool_blocks}"
            )
        return None

    def _maybe_corrupt(self, request: ServingRequest, prompt: EmbeddedPrompt) -> None:
        """The `corrupt_transfer` fault hook for embeddings: alter the landed rows (the output must change).

        `nth` counts the embedding transfers that landed on this node, from 0, in the order they finished."""
        landed = self.work.replica.services.transfers_landed
        index = landed["embedding"]
        landed["embedding"] += 1
        hits = [
            fault
            for fault in self.work.replica.services.faults
            if isinstance(fault, CorruptTransfer)
            and fault.transfer == "embedding"
            and fault.nth in (None, index)
        ]
        if hits:
            prompt.embeds.mul_(-3.0).add_(1.0)
            self.work.replica.log.bind(request_id=request.request_id).emit(
                FaultInjected(
                    fault="corrupt_transfer",
                    detail=f"embedding transfer {index} of the node (on {self.work.replica.name}) altered",
                )
            )

    def _drop(self, request: ServingRequest, *, keep_input: bool = False) -> None:
        """Take `request` out of the prefill queue (and forget its input unless kept)."""
        queue = self.work.prefill.queue
        if request in queue:
            queue.remove(request)
        if not keep_input:
            release_input(request)


def release_input(request: ServingRequest) -> None:
    """Forget a request's assembled embedding rows (they live in host tensors, not in pool blocks)."""
    request.embeds = None
    request.embed_indices = None


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
            return failure.code, f"{what} failed: {failure}"  # type: ignore[return-value]
        case PromptTooLong():
            return "bad_request", str(failure)
        case _:
            return "transfer_failed", f"{what} failed: {failure}"
