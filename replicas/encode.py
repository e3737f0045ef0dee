"""Encode behaviour: run the vision encoder on a request's images and send the rows (architecture §1, §5).

An encode replica (`Encode`, `ShuttingEncode`) takes image requests from the router, each with the
transfer id the router gave both sides (`ServingRequest.embedding_route`). For each one a helper task
(`_serve`) opens the sending session at once, so the language replica's round-0 grant is claimed and
the receiver hears "sender preparing data" while the request waits here; the encoder runs off the
event loop, one request at a time (`RoleWork.compute`); then `send_embeddings` announces the true
length with the header (the image grids), writes the rows into this replica's own embedding pool
(exactly the blocks they need, a bounded wait under memory pressure) and sends them as grants and
REQUEST_MORE_CACHE rounds arrive through the replica's command channel. The blocks are freed when the
transfer ends, whatever the outcome.

Who reports what: transfer failures are reported to the request by the language replica, which holds
the request; this side fails it only for what the language side cannot know — the encoder refused the
images (`bad_request`), this pool can never hold them (`bad_request`) or stayed full past the deadline
(`transfer_timeout`), or this replica stopped while the request depended on it (`replica_failed`).

The same object carries the language side's receives of a prefill replica (`start_receiving`, ...),
delegated to `replicas.embedding_receive`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, final

import structlog
import trio

from messages.log.events import EncodeFinished, EncodeStarted
from replicas.embedding import EncodePoolTooSmall, send_embeddings
from replicas.embedding_receive import EmbeddingReceives, release_input
from replicas.model import ImageEmbedding, ModelInputError
from replicas.request import EmbeddingRoute, ServingRequest
from transport.errors import TransferError
from transport.memory.blocks import AllocationTimeout

if TYPE_CHECKING:
    from replicas.roles import RoleWork

_log = structlog.get_logger("replicas.encode")


@final
@dataclass(eq=False, slots=True)
class EncodeJob:
    """One request's images on this encode replica, from enqueue until its transfer ended."""

    request: ServingRequest
    route: EmbeddingRoute
    pixels: int
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    encoded: trio.Event = field(default_factory=trio.Event)
    embeddings: list[ImageEmbedding] | None = None
    refusal: str | None = None


@final
class EncodeWork:
    """The encode role of one replica and the embedding receives of a language replica."""

    def __init__(self, work: RoleWork) -> None:
        self.work = work
        self.queue: deque[EncodeJob] = deque()
        self.jobs: dict[str, EncodeJob] = {}  # by transfer id: queued, encoding or sending
        self.receives = EmbeddingReceives(work)

    @property
    def idle(self) -> bool:
        return not self.jobs

    @property
    def load(self) -> int:
        """Pixels of the images queued or in flight here (the router's measure of load)."""
        return sum(job.pixels for job in self.jobs.values())

    # ------------------------------------------------------------------ encode role
    def enqueue(self, request: ServingRequest) -> None:
        """Take `request`'s images (the router set its route). The request's holder stays the
        language replica; this replica only produces and sends its embeddings."""
        route = request.embedding_route
        assert route is not None, f"request {request.request_id} reached an encode replica without a route"
        job = EncodeJob(
            request, route, pixels=sum(int(image.shape[0] * image.shape[1]) for image in request.images)
        )
        self.queue.append(job)
        self.jobs[route.transfer_id] = job
        request.cancel_hooks.append(job.scope)  # cancelled with the request, or when it ends elsewhere
        self.work.spawn(self._serve, job)

    def withdraw(self, request: ServingRequest) -> None:
        """The router could not place the language side after all: drop the job (its transfer aborts)."""
        route = request.embedding_route
        job = None if route is None else self.jobs.get(route.transfer_id)
        if job is not None:
            job.scope.cancel()

    def start_job(self) -> None:
        """Encode the next queued request (called when no compute runs)."""
        while self.queue and (self.queue[0].request.ended or self.queue[0].request.cancelled):
            self.queue.popleft().scope.cancel()
        if not self.queue:
            return
        job = self.queue.popleft()
        request = job.request
        replica = self.work.replica
        model = self.work.model
        if model is None or model.vision is None:
            job.refusal = f"{replica.name} has no vision encoder loaded"
            job.encoded.set()
            return
        vision = model.vision
        images = list(request.images)
        request.stamps.encode_started = time.time()
        replica.log.bind(request_id=request.request_id).emit(EncodeStarted(images=len(images)))
        self.work.compute(lambda: vision.encode(images), partial(self._encoded, job, time.monotonic()))

    def _encoded(
        self, job: EncodeJob, started: float, result: list[ImageEmbedding] | ModelInputError
    ) -> None:
        request = job.request
        request.stamps.encode_finished = time.time()
        if isinstance(result, ModelInputError):
            job.refusal = str(result)
            rows = 0
        else:
            job.embeddings = result
            rows = sum(embedding.grid.rows for embedding in result)
        self.work.replica.log.bind(request_id=request.request_id).emit(
            EncodeFinished(tokens=rows, seconds=time.monotonic() - started)
        )
        job.encoded.set()

    async def _serve(self, job: EncodeJob) -> None:
        """The sending side of one job (see the module docstring). Cancellation: `job.scope` is
        cancelled when the request is cancelled or ends; leaving the session aborts the transfer."""
        replica = self.work.replica
        request = job.request
        endpoint, pool, storage = (
            replica.pools.emb_endpoint,
            replica.pools.emb_pool,
            replica.pools.emb_storage,
        )
        assert endpoint is not None and pool is not None and storage is not None
        settings = replica.services.settings.embedding_transfer
        what = f"request {request.request_id}: the images' embeddings"
        try:
            with job.scope:
                async with endpoint.open_send(job.route.transfer_id) as session:
                    await job.encoded.wait()
                    if job.embeddings is None:
                        request.fail("bad_request", f"{what} could not be computed: {job.refusal}")
                        return
                    # Failures only this side knows reach the request before the session's abort
                    # reaches the language side, so the request gets this side's code and reason.
                    try:
                        await send_embeddings(
                            session,
                            pool,
                            storage,
                            job.embeddings,
                            request_id=request.request_id,
                            owner=f"encode:{job.route.transfer_id}",
                            pressure_timeout=settings.pressure_timeout,
                            on_sending=partial(_stamp_sending, request),
                        )
                    except EncodePoolTooSmall as exc:
                        request.fail("bad_request", f"{what} cannot be held by {replica.name}: {exc}")
                    except AllocationTimeout as exc:
                        request.fail("transfer_timeout", f"{what} found no room on {replica.name}: {exc}")
        except trio.Cancelled:
            if not job.scope.cancel_called and not request.ended:
                request.fail("replica_failed", f"encode replica {replica.name} stopped while serving {what}")
            raise
        except TransferError as exc:
            # The language replica holds the request and reports the transfer's failure to it.
            _log.info(
                "encode.transfer_failed", replica=replica.name, request_id=request.request_id, error=str(exc)
            )
        finally:
            self._ended(job)

    def _ended(self, job: EncodeJob) -> None:
        self.jobs.pop(job.route.transfer_id, None)
        if job in self.queue:
            self.queue.remove(job)
        job.embeddings = None
        self.work.replica.post()  # the main loop may now see the replica drained

    # ------------------------------------------------------------------ language side
    def start_receiving(self, request: ServingRequest) -> None:
        self.receives.start(request)

    def receiving(self, request: ServingRequest) -> bool:
        return self.receives.receiving(request)

    def release(self, request: ServingRequest) -> None:
        """Forget what the request holds of its embeddings. Its landing blocks were freed round by round
        by the transport; the assembled rows are host tensors."""
        release_input(request)


def _stamp_sending(request: ServingRequest) -> None:
    request.stamps.embedding_started = time.time()
