"""Receiving one KV transfer into a decode reservation: the whole prompt, or one ZigZag half.

A ZigZag request's KV arrives as two transfers into the same reserved blocks — layers `[0, n)` from the
NewPrefill replica and `[n, L)` from the OldPrefill replica — each landing only its layers' buffers
(`k{i}`, `v{i}`), addressed by absolute layer. `receive_kv_part` runs one of them and logs it.

Cancellation: the transfer runs in the request's work scope (cancelled when the request ends anywhere)
and in the caller's; either way the log still ends the transfer and the exception goes on.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import final

from messages.commands import ReserveKV
from messages.log.events import TransferFinished, TransferStarted
from messages.transfer import FailureReason, TransferReport
from replicas.fabric import Fabric, UnknownEndpoint
from replicas.model import KVCache, layer_buffer_names
from replicas.ports import EventSink
from replicas.request import ServingRequest
from transport.endpoint import TransferEndpoint
from transport.errors import HandshakeRefused, LinkError, TransferError


@final
@dataclass(frozen=True, slots=True)
class KVPart:
    transfer_id: str
    source_endpoint: str
    layers: tuple[int, int]


@final
@dataclass(frozen=True, slots=True)
class KVReceived:
    part: KVPart
    source: str
    report: TransferReport | None
    error: BaseException | None


@final
@dataclass(frozen=True, slots=True)
class KVLanding:
    """Where a decode replica lands KV: its name and log, its KV cache and the endpoint receiving into
    it, the node's fabric, the model's layer count."""

    name: str
    log: EventSink
    kv: KVCache
    endpoint: TransferEndpoint
    fabric: Fabric
    num_layers: int


async def receive_kv_part(
    landing_at: KVLanding, request: ServingRequest, table: Sequence[int], command: ReserveKV, part: KVPart
) -> KVReceived:
    endpoint, kv, fabric = landing_at.endpoint, landing_at.kv, landing_at.fabric
    destination = landing_at.name
    log = landing_at.log.bind(request_id=request.request_id)
    source = part.source_endpoint.rpartition("/")[0]
    transport = fabric.kind
    landing = list(table[: kv.blocks_for(command.prompt_tokens)])
    num_layers = landing_at.num_layers
    start, stop = part.layers
    buffers = None if (start, stop) == (0, num_layers) else layer_buffer_names(range(start, stop))
    log.emit(
        TransferStarted(
            kind="kv",
            transfer_id=part.transfer_id,
            source=source,
            destination=destination,
            transport=transport,
            total_tokens=command.prompt_tokens,
            granted_blocks=len(landing),
        )
    )
    outcome: BaseException | None = None
    report = None
    started = time.monotonic()

    def ended_without_report(reason: FailureReason) -> None:
        log.emit(
            TransferFinished(
                kind="kv",
                transfer_id=part.transfer_id,
                status="failed",
                reason=reason.value,
                rounds=0,
                tokens=0,
                bytes=0,
                seconds=time.monotonic() - started,
                source=source,
                destination=destination,
                transport=transport,
            )
        )

    try:
        with request.work_scope() as scope:  # also when the prefill side failed the request
            try:
                link = await fabric.link(endpoint, part.source_endpoint)
                result = await endpoint.receive(
                    part.transfer_id,
                    peer=link,
                    blocks=landing,
                    expected_tokens=command.prompt_tokens,
                    buffers=buffers,
                )
                report = result.report
            except (TransferError, LinkError, HandshakeRefused, UnknownEndpoint) as exc:
                outcome = exc  # that request fails (`_landed`); the replica serves on
    except BaseException:  # the replica stops, or the other half failed: the log still ends the transfer
        ended_without_report(FailureReason.ABORTED)
        raise
    if report is None and isinstance(outcome, TransferError):
        report = outcome.report
    if report is not None:
        log.emit(
            TransferFinished(
                kind="kv",
                transfer_id=part.transfer_id,
                status="success" if outcome is None else "failed",
                reason=None if report.reason is None else report.reason.value,
                rounds=report.rounds,
                tokens=report.tokens,
                bytes=report.bytes,
                seconds=report.seconds,
                source=source,
                destination=destination,
                transport=transport,
            )
        )
        fabric.count_bytes(source, destination, "kv", report.bytes)
    else:  # cancelled (the request was), or no link to the sender: the transfer ends all the same
        ended_without_report(FailureReason.ABORTED if scope.cancelled_caught else FailureReason.LINK_LOST)
    return KVReceived(part, source, report, outcome)
