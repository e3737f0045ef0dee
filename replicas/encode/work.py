"""Encode behaviour: run the vision encoder on a request's images and send the rows (architecture §1, §5).

An encode replica (`Encode`, `ShuttingEncode`) takes image requests from the router, each with the
transfer id the router gave both sides (`ServingRequest.embedding_route`). For each one a helper task
(`_serve`) opens the sending session at once, so the language replica's round-0 grant is claimed and
the receiver hears "sender preparing data" while the request waits here; the encoder runs off the
event loop, one request at a time (`replicas.step.compute`: the plan is an `EncodeCall`); then `send_embeddings` announces the true
length with the header (the image grids), writes the rows into this replica's own embedding pool
(exactly the blocks they need, a bounded wait under memory pressure) and sends them as grants and
REQUEST_MORE_CACHE rounds arrive through the replica's command channel. The blocks are freed when the
transfer ends, whatever the outcome.

Who reports what: transfer failures are reported to the request by the language replica, which holds
the request; this side fails it only for what the language side cannot know — the encoder refused the
images (`bad_request`), this pool can never hold them (`bad_request`) or stayed full past the deadline
(`transfer_timeout`), or this replica stopped while the request depended on it (`replica_failed`).

The language side of the transfer lives with the prefill role (`replicas.prefill.embeddings`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import final

import structlog
import trio

from messages.log.events import EncodeFinished, EncodeStarted
from replicas.embedding import EncodePoolTooSmall, send_embeddings
from replicas.model import ImageEmbedding, ModelInputError
from replicas.ports import Actor
from replicas.request import EmbeddingRoute, ServingRequest
from replicas.step.compute import Compute
from replicas.step.plan import EncodeCall
from transport.config import TransferConfig
from transport.endpoint import TransferEndpoint
from transport.errors import TransferError
from transport.memory.blocks import AllocationTimeout

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
    """The encode role of one replica: its jobs, sent from the embedding pool behind `endpoint`."""

    def __init__(
        self, actor: Actor, *, endpoint: TransferEndpoint, transfer: TransferConfig, compute: Compute
    ) -> None:
        self._actor = actor
        self._endpoint = endpoint
        self._transfer = transfer
        self._compute = compute
        self.queue: deque[EncodeJob] = deque()
        self.jobs: dict[str, EncodeJob] = {}  # by transfer id: queued, encoding or sending

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
        self._actor.spawn(self._serve, job)

    def withdraw(self, transfer_id: str) -> None:
        """The router could not place the language side after all: drop the job (its transfer aborts)."""
        job = self.jobs.get(transfer_id)
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
        model = self._compute.model
        if model is None or model.vision is None:
            job.refusal = f"{self._actor.name} has no vision encoder loaded"
            job.encoded.set()
            return
        vision = model.vision
        call = EncodeCall(list(request.images))
        request.stamp("encode_started")
        self._actor.log.bind(request_id=request.request_id).emit(EncodeStarted(images=len(call.images)))
        started = time.monotonic()
        self._compute.run(
            lambda: call.run(vision),
            partial(self._encoded, job, started),
            partial(self._refused, job, started),
        )

    def _encoded(self, job: EncodeJob, started: float, embeddings: list[ImageEmbedding]) -> None:
        job.embeddings = embeddings
        self._ended_encoding(job, started, sum(embedding.grid.rows for embedding in embeddings))

    def _refused(self, job: EncodeJob, started: float, error: ModelInputError) -> None:
        job.refusal = str(error)
        self._ended_encoding(job, started, 0)

    def _ended_encoding(self, job: EncodeJob, started: float, rows: int) -> None:
        request = job.request
        request.stamp("encode_finished")
        self._actor.log.bind(request_id=request.request_id).emit(
            EncodeFinished(tokens=rows, seconds=time.monotonic() - started)
        )
        job.encoded.set()

    async def _serve(self, job: EncodeJob) -> None:
        """The sending side of one job (see the module docstring). Cancellation: `job.scope` is
        cancelled when the request is cancelled or ends; leaving the session aborts the transfer."""
        replica = self._actor
        request = job.request
        endpoint = self._endpoint
        pool, storage = endpoint.pool, endpoint.storage
        settings = self._transfer
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
        self._actor.post()  # the main loop may now see the replica drained


def _stamp_sending(request: ServingRequest) -> None:
    request.stamp("embedding_started")
