"""A replica's block pools and their transfer endpoints.

Language replicas (prefill / decode) have a KV cache (`KVCache`: a `BlockPool` plus one preallocated
tensor per layer's K and V) and, for a model with a vision encoder, an embedding landing pool. Encode
replicas have an embedding pool holding encoder output until it is sent. Every pool is served by one
`TransferEndpoint` named `{replica}/kv` or `{replica}/emb`, registered with the node's fabric. Every
replica also has a weight staging pool behind `{replica}/weights` (`replicas.loading.staging`): peers copy
weights through it. It is not one of the pools `status` counts (`pools()`), but its leaks are reported.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import final

import trio

from messages.faults import DropLink, StallSender
from replicas.loading.staging import WeightStaging
from replicas.model import KVCache, embedding_layout
from replicas.services import ReplicaServices
from replicas.states import Role
from replicas.zigzag.wire import relay_layout, relay_pool_blocks
from transport.config import TransferConfig
from transport.endpoint import SenderDelivery, TransferEndpoint, open_endpoint
from transport.faults import NO_FAULTS, FaultPlan
from transport.memory.blocks import BlockPool
from transport.memory.storage import PoolStorage


@final
class ReplicaPools:
    """The pools of replica `name` (see the module docstring)."""

    def __init__(self, name: str, role: Role, services: ReplicaServices) -> None:
        self.name = name
        self.services = services
        settings = services.settings
        config = services.host.config
        self.kv: KVCache | None = None
        self.emb_pool: BlockPool | None = None
        self.emb_storage: PoolStorage | None = None
        if role in ("prefill", "decode"):
            self.kv = KVCache.create(
                config,
                settings.kv_pool_blocks,
                block_size=settings.kv_block_size,
                device=services.host.device,
                name=f"{name}/kv",
            )
        if role == "encode" or (config.image_token_id is not None and role == "prefill"):
            layout = embedding_layout(config.hidden_size, settings.embedding_block_size)
            blocks = settings.embedding_pool_blocks
            if role == "encode":  # `--embedding-pool-blocks` sizes the landing pools; an encode pool
                # holds whole requests (docs/epd.md), so at least one maximum-context request's rows.
                blocks = max(blocks, -(-config.max_position_embeddings // layout.block_size))
            self.emb_pool = BlockPool(blocks, layout.block_size, name=f"{name}/emb")
            self.emb_storage = PoolStorage(layout, blocks, device="cpu")
        self.relay_pool: BlockPool | None = None
        self.relay_storage: PoolStorage | None = None
        if role in ("prefill", "decode"):  # ZigZag relays: hidden states between prefill replicas
            relay = relay_layout(config)
            blocks = relay_pool_blocks(settings.max_batch_tokens, relay.block_size)
            self.relay_pool = BlockPool(blocks, relay.block_size, name=f"{name}/relay")
            self.relay_storage = PoolStorage(relay, blocks, device=services.host.device)
        self.kv_endpoint: TransferEndpoint | None = None
        self.emb_endpoint: TransferEndpoint | None = None
        self.relay_endpoint: TransferEndpoint | None = None
        self.weights = WeightStaging(name, settings.weights_pool_blocks, services.host.device)

    @property
    def kv_endpoint_name(self) -> str:
        return f"{self.name}/kv"

    @property
    def emb_endpoint_name(self) -> str:
        return f"{self.name}/emb"

    @property
    def relay_endpoint_name(self) -> str:
        return f"{self.name}/relay"

    async def open_endpoints(
        self, stack: AsyncExitStack, sender_control: trio.MemorySendChannel[SenderDelivery]
    ) -> None:
        """Open and register this replica's endpoints; they close when `stack` unwinds."""
        fabric = self.services.fabric
        settings = self.services.settings
        faults = self._fault_plan()

        async def open_one(
            name: str, storage: PoolStorage, pool: BlockPool, config: TransferConfig
        ) -> TransferEndpoint:
            endpoint = await stack.enter_async_context(
                open_endpoint(
                    name,
                    storage,
                    pool,
                    config=config,
                    faults=faults,
                    inproc=fabric.inproc,
                    sender_control=sender_control,
                )
            )
            await fabric.listen(endpoint)
            stack.callback(fabric.forget, name)
            return endpoint

        if self.kv is not None:
            self.kv_endpoint = await open_one(
                self.kv_endpoint_name, self.kv.storage, self.kv.pool, settings.kv_transfer
            )
        if self.emb_pool is not None and self.emb_storage is not None:
            self.emb_endpoint = await open_one(
                self.emb_endpoint_name, self.emb_storage, self.emb_pool, settings.embedding_transfer
            )
        if self.relay_pool is not None and self.relay_storage is not None:
            self.relay_endpoint = await open_one(
                self.relay_endpoint_name, self.relay_storage, self.relay_pool, settings.kv_transfer
            )
        staging = self.weights
        staging.endpoint = await open_one(
            staging.endpoint_name, staging.storage, staging.pool, settings.weights_transfer
        )

    def deliver(self, delivery: SenderDelivery) -> None:
        """Hand a sender-bound protocol message to the endpoint whose link it came on."""
        for endpoint in (self.kv_endpoint, self.emb_endpoint, self.relay_endpoint, self.weights.endpoint):
            if endpoint is not None and delivery.link.local == endpoint.name:
                endpoint.deliver(delivery)
                return
        raise AssertionError(f"{self.name}: message on a link of no endpoint of this replica: {delivery}")

    # ------------------------------------------------------------------ accounting
    def pools(self) -> list[BlockPool]:
        """The pools `status` counts: KV and embeddings (staging pools are transient: see `all_pools`)."""
        found = [] if self.kv is None else [self.kv.pool]
        return found + ([] if self.emb_pool is None else [self.emb_pool])

    def all_pools(self) -> list[BlockPool]:
        """Every pool, the relay and weight staging pools too (freed after a crash, checked for leaks)."""
        relay = [] if self.relay_pool is None else [self.relay_pool]
        return [*self.pools(), *relay, self.weights.pool]

    def kv_usage(self) -> tuple[int, int]:
        if self.kv is None:
            return 0, 0
        return self.kv.pool.used_blocks, self.kv.pool.num_blocks

    def used_blocks(self) -> int:
        return sum(pool.used_blocks for pool in self.pools())

    def total_blocks(self) -> int:
        return sum(pool.num_blocks for pool in self.pools())

    def free_everything(self) -> int:
        """Return every block to its pool (after a crash, once no transfer can write any more)."""
        freed = 0
        for pool in self.all_pools():
            for owner in list(pool.owners()):
                freed += pool.free_owner(owner)
        return freed

    def leaks(self) -> dict[str, dict[str, int]]:
        """Pool name → owner → blocks still allocated."""
        return {pool.name: pool.leaks() for pool in self.all_pools() if pool.leaks()}

    def _fault_plan(self) -> FaultPlan:
        plan = NO_FAULTS
        for fault in self.services.faults:
            if isinstance(fault, StallSender) and fault.replica == self.name:
                plan = FaultPlan(stall_before_round=0, stall_seconds=fault.seconds)
            elif isinstance(fault, DropLink) and fault.source == self.name:
                plan = FaultPlan(drop_link_after_bytes=max(1, fault.after_bytes))
        return plan
