"""Per-replica sizes and limits, from the node's config (`replicas/` never imports `engine/`: the node
maps its `NodeConfig` into `ReplicaSettings`)."""

from __future__ import annotations

import msgspec

from replicas.emulation import EmulatedSpeed
from replicas.model.gpu.options import AttentionChoice, GraphsChoice
from transport.config import TransferConfig


class ReplicaSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Per-replica sizes and limits (from the node's config)."""

    kv_block_size: int = 16
    kv_pool_blocks: int = 2048
    embedding_block_size: int = 128
    embedding_pool_blocks: int = 256
    embedding_default_blocks: int = 8
    embedding_max_grant_blocks: int | None = None
    # The prefix cache (docs/prefix-cache.md): keep ended requests' full KV blocks for reuse, at most
    # `prefix_cache_blocks` of them (None: as many as the pool spares).
    prefix_cache: bool = True
    prefix_cache_blocks: int | None = None
    max_batch_tokens: int = 4096
    # Chunked prefill: a prompt longer than this runs in chunks of at most this many tokens, other
    # requests' between them (`replicas.prefill.schedule`); None: whole prompts.
    chunk_tokens: int | None = None
    max_batch_size: int = 64
    migration_wait: float = 60.0
    migrations_in_flight: int = 8
    kv_transfer: TransferConfig = msgspec.field(default_factory=TransferConfig)
    embedding_transfer: TransferConfig = msgspec.field(default_factory=TransferConfig)
    # A replica's weight staging pool (`replicas.loading.staging`): blocks of 1 MiB, what one peer weight
    # transfer carries at most; and its endpoint's knobs.
    weights_pool_blocks: int = 16
    weights_transfer: TransferConfig = msgspec.field(default_factory=TransferConfig)
    emulated: EmulatedSpeed = msgspec.field(default_factory=EmulatedSpeed)
    # ZigZag: an OldPrefill replica also serves its own queue between relays (relays first).
    old_prefill_serves_queue: bool = True
    # How executors run the model (`[executor]`, replicas/model/gpu/options.py).
    attention: AttentionChoice = "auto"
    cuda_graphs: GraphsChoice = "auto"
