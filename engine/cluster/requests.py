"""Requests that cross nodes: snapshots, mirrors, and what the origin does with forwarded updates.

The origin of a request (the node that admitted it) keeps the authoritative `ServingRequest`; a node
that works on it holds a *mirror* built from a `RequestSnapshot`. A mirror's holder appends tokens and
ends it exactly as it would a local request; the mirror's `on_tokens` and `on_end` hooks forward that to
the origin, which applies it in index order (`apply_tokens`: a token the origin already has is skipped,
one past a gap waits for the gap) and ends its request with the mirror's outcome (`apply_ended`).
Log-probabilities, where the request asked for them, travel with the tokens they score.
When the request already lives on the node a snapshot reaches (the origin itself, or a node that
encoded it), the snapshot updates that object instead (`merge_snapshot`).

The rule for writes across nodes: progress made on another node reaches this node's object only through
`ServingRequest.merge` — snapshots, forwarded tokens and the forwarded end are each turned into one
`HolderReport` here and merged; merging only adds what this node does not know (the request's docstring
says what exactly), so a late or repeated report changes nothing. The transfers and the relay record
are merged beside it (`merge_transfers`; the first relay record stays).
"""

from __future__ import annotations

from dataclasses import fields

import numpy as np

from engine.generate.logprobs import logprob_value, prompt_records, prompt_values, records
from messages.cluster import EndedForward, ImageData, RequestSnapshot, SamplingRecord, StampsRecord
from messages.control_replies import TokenLogprob, TransferSummary
from replicas.model import SamplingParams
from replicas.request import EmbeddingRoute, FailedUpdate, HolderReport, RequestSpec, ServingRequest, Stamps

_STAMPS = [f.name for f in fields(Stamps)]


def snapshot(request: ServingRequest, origin: str, *, images: bool) -> RequestSnapshot:
    """`request` as far as it got; with its images only for a node that encodes or prefills it."""
    sampling = request.sampling
    route = request.embedding_route
    return RequestSnapshot(
        request_id=request.request_id,
        origin=origin,
        prompt_ids=list(request.prompt_ids),
        images=[_image(image) for image in request.images] if images else [],
        sampling=SamplingRecord(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=sampling.seed,
            ignore_eos=sampling.ignore_eos,
            eos_banned_before=sampling.eos_banned_before,
            eos_token_ids=list(sampling.eos_token_ids),
            logprobs=request.logprobs,
            prompt_logprobs=request.prompt_logprobs,
            grammar=sampling.grammar,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            repetition_penalty=sampling.repetition_penalty,
            logit_bias=sampling.logit_bias,
        ),
        max_tokens=request.max_tokens,
        eos_token_ids=list(request.eos_token_ids),
        token_ids=list(request.token_ids),
        generated=list(request.generated),
        next_position=request.next_position,
        stop_at=request.stop_at,
        cancelled=request.cancelled,
        stamps=stamps_record(request.stamps),
        transfers=list(request.transfers),
        relay=request.relay,
        embedding_encoder=None if route is None else route.encoder,
        embedding_transfer_id=None if route is None else route.transfer_id,
        generated_logprobs=records(request.generated_logprobs),
        prompt_logprobs=prompt_records(request.prompt_scores),
        cached_tokens=request.cached_tokens,
        cached_from=request.cached_from,
        pull_from=request.pull_from,
        pull_blocks=request.pull_blocks,
    )


def mirror(snap: RequestSnapshot) -> ServingRequest:
    """A new request object for this node, as `snap` describes it."""
    s = snap.sampling
    spec = RequestSpec.of(
        request_id=snap.request_id,
        prompt_ids=snap.prompt_ids,
        images=[np.frombuffer(i.data, dtype=i.dtype).reshape(i.shape).copy() for i in snap.images],
        sampling=SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            ignore_eos=s.ignore_eos,
            eos_banned_before=s.eos_banned_before,
            eos_token_ids=tuple(s.eos_token_ids),
            grammar=s.grammar,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repetition_penalty,
            logit_bias=tuple((token, value) for token, value in s.logit_bias),
        ),
        max_tokens=snap.max_tokens,
        logprobs=s.logprobs,
        prompt_logprobs=s.prompt_logprobs,
    )
    request = ServingRequest(spec, eos_token_ids=snap.eos_token_ids)
    merge_snapshot(request, snap)
    return request


def merge_snapshot(request: ServingRequest, snap: RequestSnapshot) -> None:
    """Bring `request` up to `snap`: its laid-out prompt, tokens, stamps, transfers and route (the rule:
    `ServingRequest.merge`)."""
    merge_transfers(request, snap.transfers)
    request.relay = request.relay or snap.relay
    route = None
    if snap.embedding_encoder is not None and snap.embedding_transfer_id is not None:
        route = EmbeddingRoute(snap.embedding_encoder, snap.embedding_transfer_id)
    request.merge(
        HolderReport(
            generated=snap.generated,
            generated_logprobs=[logprob_value(entry) for entry in snap.generated_logprobs],
            emit=False,
            token_ids=snap.token_ids,
            next_position=snap.next_position,
            prompt_scores=prompt_values(snap.prompt_logprobs),
            stamps=_stamps(snap.stamps),
            cached_tokens=snap.cached_tokens,
            cached_from=snap.cached_from,
            pull=(snap.pull_from, snap.pull_blocks),
            stop_at=snap.stop_at,
            embedding_route=route,
            cancelled=snap.cancelled,
        )
    )


def apply_tokens(
    request: ServingRequest,
    start: int,
    token_ids: list[int],
    *,
    logprobs: list[TokenLogprob] | None = None,
) -> None:
    """Append the tokens `[start, start + n)` this request does not have yet (see the module docstring),
    and their `logprobs` where they come with them, and stream them."""
    scored = [logprob_value(entry) for entry in logprobs] if logprobs else ()
    request.merge(HolderReport(tokens_from=start, generated=token_ids, generated_logprobs=scored))


def apply_ended(request: ServingRequest, ended: EndedForward) -> None:
    """End the origin's `request` as its mirror ended (tokens not yet applied are applied first)."""
    request.merge(
        HolderReport(
            generated=ended.generated,
            generated_logprobs=[logprob_value(entry) for entry in ended.generated_logprobs],
            token_ids=ended.token_ids,  # the prompt as laid out there (images expanded)
            prompt_scores=prompt_values(ended.prompt_logprobs),
            stamps=_stamps(ended.stamps),
        )
    )
    merge_transfers(request, ended.transfers)
    request.relay = request.relay or ended.relay
    if ended.outcome == "failed":
        assert ended.code is not None
        request.fail(ended.code, ended.message or "failed on another node")
    else:
        request.finish(ended.finish_reason or "stop")


def ended_forward(request: ServingRequest) -> EndedForward:
    update = request.final_update
    failed = isinstance(update, FailedUpdate)
    return EndedForward(
        request_id=request.request_id,
        outcome="failed" if failed else "finished",
        finish_reason=None if failed or update is None else update.finish_reason,  # type: ignore[union-attr]
        code=update.code if isinstance(update, FailedUpdate) else None,
        message=update.message if isinstance(update, FailedUpdate) else None,
        token_ids=list(request.token_ids),
        generated=list(request.generated),
        stamps=stamps_record(request.stamps),
        transfers=list(request.transfers),
        relay=request.relay,
        generated_logprobs=records(request.generated_logprobs),
        prompt_logprobs=prompt_records(request.prompt_scores),
    )


def stamps_record(stamps: Stamps) -> StampsRecord:
    return StampsRecord(**{name: getattr(stamps, name) for name in _STAMPS})


def _stamps(record: StampsRecord) -> dict[str, float | None]:
    return {name: getattr(record, name) for name in _STAMPS}


def merge_transfers(request: ServingRequest, transfers: list[TransferSummary]) -> None:
    """Add the transfers `request` does not list yet (by transfer id)."""
    for summary in transfers:
        if all(t.transfer_id != summary.transfer_id for t in request.transfers):
            request.transfers.append(summary)


def _image(image: np.ndarray) -> ImageData:
    array = np.ascontiguousarray(image)
    return ImageData(shape=list(array.shape), dtype=str(array.dtype), data=array.tobytes())
