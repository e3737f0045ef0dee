"""A replica's block pools and their transfer endpoints, typed by the role it was configured for.

A language replica (configured prefill or decode: `LanguagePools`) has a KV cache (`KVCache`: a
`BlockPool` plus one preallocated tensor per layer's K and V), a relay pool for ZigZag's hidden states
and — a prefill replica of a model with a vision encoder — an embedding landing pool. An encode replica
(`EncodePools`) has an embedding pool holding encoder output until it is sent. Every replica also has a
weight staging pool behind `{replica}/weights` (`replicas.loading.staging`), through which peers copy
weights; it is not one of the pools `status` counts (`counted`), but its leaks are reported.

The pools exist from construction; `open` opens one `TransferEndpoint` per pool (named `{replica}/kv`,
`/emb`, `/relay`, `/weights`), registered with the node's fabric, and returns them typed (`Language
Endpoints`, `EncodeEndpoints`): the role parts are built from those, so none of them holds an optional
pool. The endpoints close when the replica's run unwinds.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import final

import trio

from replicas.fabric import Fabric
from replicas.loading.staging import WeightStaging
from replicas.model import KVCache, ModelConfig, embedding_layout
from replicas.settings import ReplicaSettings
from replicas.zigzag.wire import relay_layout, relay_pool_blocks
from transport.config import TransferConfig
from transport.endpoint import SenderDelivery, TransferEndpoint, open_endpoint
from transport.faults import FaultPlan
from transport.memory.blocks import BlockPool
from transport.memory.prefix_cache import CACHE_OWNER
from transport.memory.storage import PoolStorage


@final
@dataclass(frozen=True, slots=True)
class LanguageEndpoints:
    """The open endpoints of a language replica."""

    kv: TransferEndpoint
    relay: TransferEndpoint
    emb: TransferEndpoint | None  # an embedding landing pool: a prefill replica of a vision model
    weights: TransferEndpoint


@final
@dataclass(frozen=True, slots=True)
class EncodeEndpoints:
    """The open endpoints of an encode replica."""

    emb: TransferEndpoint
    weights: TransferEndpoint


class _Pools:
    """What every replica's pools share: accounting over `counted` (status) and `every` pool."""

    def __init__(self, name: str, counted: list[BlockPool], weights: WeightStaging, others: list[BlockPool]):
        self.name = name
        self.weights = weights
        self.counted = counted
        self.every = [*counted, *others, weights.pool]
        self._endpoints: list[TransferEndpoint] = []

    def used_blocks(self) -> int:
        return sum(pool.used_blocks for pool in self.counted)

    def total_blocks(self) -> int:
        return sum(pool.num_blocks for pool in self.counted)

    def kv_usage(self) -> tuple[int, int]:
        """(used, total) KV blocks; (0, 0) without a KV cache."""
        return 0, 0

    def prefix_blocks(self) -> int:
        """KV blocks the prefix cache holds; 0 without a KV cache."""
        return 0

    def prefix_evicted(self) -> int:
        """KV blocks the prefix cache has evicted since the replica started; 0 without a KV cache."""
        return 0

    def free_everything(self) -> int:
        """Return every block to its pool (after a crash, once no transfer can write any more)."""
        freed = 0
        for pool in self.every:
            for owner in list(pool.owners()):
                freed += pool.free_owner(owner)
        return freed

    def leaks(self) -> dict[str, dict[str, int]]:
        """Pool name → owner → blocks still allocated."""
        return {pool.name: pool.leaks() for pool in self.every if pool.leaks()}

    def deliver(self, delivery: SenderDelivery) -> None:
        """Hand a sender-bound protocol message to the endpoint whose link it came on."""
        for endpoint in self._endpoints:
            if delivery.link.local == endpoint.name:
                endpoint.deliver(delivery)
                return
        raise AssertionError(f"{self.name}: message on a link of no endpoint of this replica: {delivery}")

    async def _open(
        self,
        stack: AsyncExitStack,
        fabric: Fabric,
        faults: FaultPlan,
        sender_control: trio.MemorySendChannel[SenderDelivery],
        name: str,
        storage: PoolStorage,
        pool: BlockPool,
        config: TransferConfig,
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
        stack.callback(self._endpoints.remove, endpoint)
        self._endpoints.append(endpoint)
        return endpoint


def _embedding_pool(
    name: str, config: ModelConfig, settings: ReplicaSettings, *, whole_requests: bool
) -> tuple[BlockPool, PoolStorage]:
    layout = embedding_layout(config.hidden_size, settings.embedding_block_size)
    blocks = settings.embedding_pool_blocks
    if whole_requests:  # `--embedding-pool-blocks` sizes the landing pools; an encode pool holds whole
        # requests (docs/epd.md), so at least one maximum-context request's rows.
        blocks = max(blocks, -(-config.max_position_embeddings // layout.block_size))
    return BlockPool(blocks, layout.block_size, name=f"{name}/emb"), PoolStorage(layout, blocks, device="cpu")


@final
class LanguagePools(_Pools):
    """The pools of a prefill or decode replica (see the module docstring)."""

    def __init__(
        self, name: str, config: ModelConfig, settings: ReplicaSettings, device: str, *, landing: bool
    ) -> None:
        self.kv = KVCache.create(
            config,
            settings.kv_pool_blocks,
            block_size=settings.kv_block_size,
            device=device,
            name=f"{name}/kv",
            prefix_cache=settings.prefix_cache,
            prefix_cache_blocks=settings.prefix_cache_blocks,
        )
        self.emb: tuple[BlockPool, PoolStorage] | None = None
        if landing:
            self.emb = _embedding_pool(name, config, settings, whole_requests=False)
        relay = relay_layout(config)
        relay_blocks = relay_pool_blocks(settings.max_batch_tokens, relay.block_size)
        self.relay = BlockPool(relay_blocks, relay.block_size, name=f"{name}/relay")
        self.relay_storage = PoolStorage(relay, relay_blocks, device=device)
        counted = [self.kv.pool] + ([] if self.emb is None else [self.emb[0]])
        super().__init__(
            name, counted, WeightStaging(name, settings.weights_pool_blocks, device), [self.relay]
        )

    def used_blocks(self) -> int:
        """Blocks held for requests: cached blocks no request references are as good as free."""
        return super().used_blocks() - self.kv.prefix.evictable_blocks

    def kv_usage(self) -> tuple[int, int]:
        return self.kv.pool.used_blocks - self.kv.prefix.evictable_blocks, self.kv.pool.num_blocks

    def prefix_blocks(self) -> int:
        return self.kv.prefix.cached_blocks

    def prefix_evicted(self) -> int:
        return self.kv.prefix.evicted_blocks

    def leaks(self) -> dict[str, dict[str, int]]:
        """As `_Pools.leaks`, but the prefix cache's own blocks are kept on purpose: only a borrowing
        never given back counts (under its owner's name)."""
        found = super().leaks()
        kv = found.pop(self.kv.pool.name, {})
        kv.pop(CACHE_OWNER, None)
        for owner, blocks in self.kv.prefix.borrowings().items():
            kv[owner] = kv.get(owner, 0) + blocks
        if kv:
            found[self.kv.pool.name] = kv
        return found

    def free_everything(self) -> int:
        self.kv.prefix.clear()  # its entries and borrowings go with the blocks
        return super().free_everything()

    async def open(
        self,
        stack: AsyncExitStack,
        fabric: Fabric,
        settings: ReplicaSettings,
        faults: FaultPlan,
        sender_control: trio.MemorySendChannel[SenderDelivery],
    ) -> LanguageEndpoints:
        """Open and register this replica's endpoints; they close when `stack` unwinds."""
        args = (stack, fabric, faults, sender_control)
        kv = await self._open(*args, f"{self.name}/kv", self.kv.storage, self.kv.pool, settings.kv_transfer)
        emb = None
        if self.emb is not None:
            pool, storage = self.emb
            emb = await self._open(*args, f"{self.name}/emb", storage, pool, settings.embedding_transfer)
        relay = await self._open(
            *args, f"{self.name}/relay", self.relay_storage, self.relay, settings.kv_transfer
        )
        staging = self.weights
        weights = await self._open(
            *args, staging.endpoint_name, staging.storage, staging.pool, settings.weights_transfer
        )
        staging.endpoint = weights
        stack.callback(setattr, staging, "endpoint", None)
        return LanguageEndpoints(kv=kv, relay=relay, emb=emb, weights=weights)


@final
class EncodePools(_Pools):
    """The pools of an encode replica (see the module docstring)."""

    def __init__(self, name: str, config: ModelConfig, settings: ReplicaSettings, device: str) -> None:
        self.emb_pool, self.emb_storage = _embedding_pool(name, config, settings, whole_requests=True)
        super().__init__(name, [self.emb_pool], WeightStaging(name, settings.weights_pool_blocks, device), [])

    async def open(
        self,
        stack: AsyncExitStack,
        fabric: Fabric,
        settings: ReplicaSettings,
        faults: FaultPlan,
        sender_control: trio.MemorySendChannel[SenderDelivery],
    ) -> EncodeEndpoints:
        """Open and register this replica's endpoints; they close when `stack` unwinds."""
        args = (stack, fabric, faults, sender_control)
        emb = await self._open(
            *args, f"{self.name}/emb", self.emb_storage, self.emb_pool, settings.embedding_transfer
        )
        staging = self.weights
        weights = await self._open(
            *args, staging.endpoint_name, staging.storage, staging.pool, settings.weights_transfer
        )
        staging.endpoint = weights
        stack.callback(setattr, staging, "endpoint", None)
        return EncodeEndpoints(emb=emb, weights=weights)
