"""Log events of live scaling (architecture §8); part of the `messages.log.events.LogEvent` union.

A replica's own weight copy (`replicas.loading`): its start and its end. Each landed piece in between is
a `messages.log.events.WeightsProgress` (with `piece`, `layer`, `bytes`, `piece_seconds`, `weights_source`,
`bytes_loaded`). `copy` numbers the node's weight copies from 1 (the `nth` of the `hold_weights` fault
hook). The source fields are `weights_source`, not `source`: `source` names a replica in the log's other
events (`python -m engine.logs` qualifies it when it merges nodes' logs).

ZigZag (`replicas.zigzag`): pairing, and each relay as handed over and as received. The planner
(`engine.planner`): each decision, with what it read.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec

from messages.log.base import Event, Level, ReplicaEvent

WeightsSourceName = Literal["peer", "host", "disk"]


class ExecutorReady(ReplicaEvent, frozen=True, kw_only=True, tag="executor_ready"):
    """A replica's whole model is loaded and its executor built (docs/gpu.md): `path` (`graphs`, `kernels`,
    `eager`), the batch sizes it captured decode graphs for, `seconds` spent building it (the kernels'
    check and the graph captures), and why a faster path was given up (`fallbacks`; empty normally)."""

    path: Literal["graphs", "kernels", "eager"]
    graph_batches: list[int]
    seconds: float
    fallbacks: list[str]


class WeightsFallback(msgspec.Struct, frozen=True, kw_only=True):
    """`weights_source` failed at `piece` (the label of the first piece it did not land: `layer 3`); the copy went
    on from the next source, from that piece."""

    weights_source: WeightsSourceName
    piece: str
    reason: str


class WeightsCopyStarted(ReplicaEvent, frozen=True, kw_only=True, tag="weights_copy_started"):
    """A replica starts loading its own copy of the weights: `requested` is the source it was asked for
    (`auto`, `peer`, `host`, `disk`), `sources` the ones it will try in order (`peer` once per peer
    replica), `peer` the replica a peer copy reads from first (null: none), `peers` every peer replica it
    may read from, in order (this node's first, then other nodes' on the same host, then elsewhere), and
    `reason` why the first source was chosen."""

    copy: int
    requested: Literal["auto", "peer", "host", "disk"]
    sources: list[WeightsSourceName]
    peer: str | None
    peers: list[str] = msgspec.field(default_factory=list)
    reason: str = ""
    total_bytes: int
    total_layers: int
    device: str


class WeightsCopyFinished(ReplicaEvent, frozen=True, kw_only=True, tag="weights_copy_finished"):
    """The copy ended: `status` `success` (every piece landed; `weights_source` loaded the last one), `failed`
    (`reason` says why) or `aborted` (the replica stopped). `fallbacks`: the sources given up on the way."""

    level: ClassVar[Level] = "info"

    copy: int
    status: Literal["success", "failed", "aborted"]
    weights_source: WeightsSourceName | None
    fallbacks: list[WeightsFallback]
    reason: str | None
    bytes: int
    seconds: float


# ------------------------------------------------------------------------------------------- zigzag
class ReplicasPaired(ReplicaEvent, frozen=True, kw_only=True, tag="replicas_paired"):
    """A scale paired NewPrefill replica `new_prefill` with OldPrefill replica `old_prefill`."""

    new_prefill: str
    old_prefill: str


class RelayHandedOver(ReplicaEvent, frozen=True, kw_only=True, tag="relay_handed_over"):
    """A NewPrefill replica handed batch `batch_id` over after layers `[0, layer)`."""

    batch_id: str
    new_prefill: str
    old_prefill: str
    layer: int
    requests: int
    tokens: int


class RelayReceived(ReplicaEvent, frozen=True, kw_only=True, tag="relay_received"):
    """An OldPrefill replica received the hidden states of batch `batch_id`."""

    batch_id: str
    new_prefill: str
    old_prefill: str
    layer: int
    bytes: int
    seconds: float


# ------------------------------------------------------------------------------------------- planner
class PlannerInputs(msgspec.Struct, frozen=True, kw_only=True):
    """What the planner read in one pass (docs/planner.md): the load and the capacity measured."""

    waiting_tokens: int
    arriving_tokens_per_s: float
    prefill_tokens_per_s: float
    decode_used_blocks: int
    decode_blocks_per_replica: int
    migration_bytes_per_s: float
    migration_bytes_per_s_per_replica: float
    slo_miss_fraction: float = 0.0
    arriving_requests_per_s: float = 0.0  # the queueing band's arrival rate (engine/planner/queueing.py)


class PlannerForecast(msgspec.Struct, frozen=True, kw_only=True):
    """The forecast a decision took as its floor (docs/planner.md): `predictor`'s load over the next
    `horizon_s` seconds — the provisioning lead time measured for a copy from `lead_source` (null: not
    measured yet, `--autoscale-lead-time`) — and the replicas of the role it needs (`floor`)."""

    predictor: Literal["constant", "ewma", "kalman", "periodic"]
    horizon_s: float
    lead_source: WeightsSourceName | None
    arriving_tokens_per_s: float
    requests_per_s: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    floor: int
    arriving_tokens_per_s_q90: float = 0.0  # the quantile the prefill floor is sized to


class PlannerDecision(Event, frozen=True, kw_only=True, tag="planner_decision"):
    """One planner pass for `role`: `current` replicas, the range `[low, high]` its signals ask for, and
    the `target` it moves to (`action`), or why it made no decision (`skip`, with `reason`). `forecast`:
    the floor the predictor set (null: `--autoscale-predictor none`); `advisory`: decided only, not acted
    on (`--autoscale-advisory`)."""

    role: Literal["prefill", "decode"]
    policy: Literal["blitz", "serverless"]
    action: Literal["keep", "scale_up", "scale_down", "release", "skip"]
    current: int
    target: int
    low: int
    high: int
    reason: str
    inputs: PlannerInputs
    forecast: PlannerForecast | None = None
    advisory: bool = False
