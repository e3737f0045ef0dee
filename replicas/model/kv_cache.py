"""The paged KV cache: a `BlockPool` (who owns which block) plus a `PoolStorage` with the KV layout.

Layout (architecture §4): buffers `k0, v0, k1, v1, …` — one pair per layer, in layer order — each with a
per-token shape `[num_kv_heads, head_dim]` in the model's dtype. Token `t` of a sequence with block table
`ids` lives in block `ids[t // block_size]`, row `t % block_size`. Keys are stored after rotary embedding,
so a block's bytes mean the same thing in every replica of the model: migration copies them as they are.

Thread safety: the allocator is driven by the replica's Trio task only; executor threads read and write
the storage of the blocks their batch owns, never the allocator.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import final

import torch

from messages.layout import BufferSpec, PoolLayout
from replicas.model.config import ModelConfig
from replicas.model.errors import ContextLengthError, InvalidBatchError
from transport.memory.blocks import BlockPool
from transport.memory.prefix_cache import PrefixCache
from transport.memory.storage import PoolStorage, token_rows

DEFAULT_KV_BLOCK_SIZE = 16


def key_name(layer: int) -> str:
    return f"k{layer}"


def value_name(layer: int) -> str:
    return f"v{layer}"


def kv_layout(config: ModelConfig, block_size: int = DEFAULT_KV_BLOCK_SIZE) -> PoolLayout:
    """The KV pool layout of a model; two caches can exchange blocks only when their layouts are equal."""
    shape = (config.num_kv_heads, config.head_dim)
    buffers: list[BufferSpec] = []
    for layer in range(config.num_layers):
        buffers.append(BufferSpec(name=key_name(layer), shape=shape, dtype=config.dtype))
        buffers.append(BufferSpec(name=value_name(layer), shape=shape, dtype=config.dtype))
    return PoolLayout(block_size=block_size, buffers=tuple(buffers))


def layer_buffer_names(layers: range) -> list[str]:
    """Buffer names of a layer range, in layout order."""
    return [name for layer in layers for name in (key_name(layer), value_name(layer))]


@final
class KVCache:
    """The KV blocks of one replica. `pool` allocates (owners = request ids); `storage` holds the bytes;
    `prefix` keeps the full blocks of ended requests for reuse (`transport.memory.prefix_cache`; off
    unless given). A request's table goes back through `release`, never straight to the pool."""

    def __init__(
        self, config: ModelConfig, storage: PoolStorage, pool: BlockPool, *, prefix: PrefixCache | None = None
    ) -> None:
        expected = kv_layout(config, storage.block_size)
        problem = storage.layout.mismatch(expected)
        if problem is not None:
            raise InvalidBatchError(f"KV storage does not match the model: {problem}")
        if pool.block_size != storage.block_size or pool.num_blocks != storage.num_blocks:
            raise InvalidBatchError(
                f"KV pool ({pool.num_blocks} blocks of {pool.block_size}) and storage "
                f"({storage.num_blocks} blocks of {storage.block_size}) disagree"
            )
        self.config = config
        self.storage = storage
        self.pool = pool
        self.prefix = prefix if prefix is not None else PrefixCache(pool, enabled=False)
        if self.prefix.pool is not pool:
            raise InvalidBatchError("the prefix cache was built over another pool than the KV cache's")
        self.block_size = storage.block_size
        self.num_blocks = storage.num_blocks
        self.device = storage.device
        self._keys = [storage.flat(key_name(i)) for i in range(config.num_layers)]
        self._values = [storage.flat(value_name(i)) for i in range(config.num_layers)]

    @classmethod
    def create(
        cls,
        config: ModelConfig,
        num_blocks: int,
        *,
        block_size: int = DEFAULT_KV_BLOCK_SIZE,
        device: str | torch.device = "cpu",
        name: str = "kv",
        prefix_cache: bool = False,
        prefix_cache_blocks: int | None = None,
    ) -> KVCache:
        """A KV cache of `num_blocks` blocks; `prefix_cache`: keep ended requests' full blocks (at most
        `prefix_cache_blocks`; None: as many as the pool spares)."""
        storage = PoolStorage(kv_layout(config, block_size), num_blocks, device=device)
        pool = BlockPool(num_blocks, block_size, name=name)
        prefix = PrefixCache(pool, max_blocks=prefix_cache_blocks, enabled=prefix_cache)
        return cls(config, storage, pool, prefix=prefix)

    def release(self, table: Sequence[int], owner: str) -> None:
        """`owner`'s request ended here: its blocks go back (see `PrefixCache.release`)."""
        self.prefix.release(owner, table)

    def blocks_for(self, tokens: int) -> int:
        """Blocks a sequence of `tokens` tokens needs (the caller allocates before each step)."""
        return self.pool.blocks_for(tokens)

    def keys(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s keys as `[num_blocks * block_size, num_kv_heads, head_dim]` (a view)."""
        return self._keys[layer]

    def values(self, layer: int) -> torch.Tensor:
        return self._values[layer]

    def check_block_table(self, block_table: Sequence[int], tokens: int, what: str) -> None:
        """Raise unless `block_table` names real blocks and holds at least `tokens` tokens."""
        if len(block_table) * self.block_size < tokens:
            raise ContextLengthError(
                f"{what}: {tokens} tokens need {self.blocks_for(tokens)} blocks of {self.block_size}, "
                f"the block table has {len(block_table)}"
            )
        if not block_table:
            return
        low, high = min(block_table), max(block_table)
        if low < 0 or high >= self.num_blocks:
            bad = low if low < 0 else high
            raise InvalidBatchError(f"{what}: block id {bad} outside [0, {self.num_blocks})")

    # ------------------------------------------------------------------ export / import
    def export_kv(self, block_table: Sequence[int], tokens: int, layers: range) -> dict[str, torch.Tensor]:
        """Tokens `[0, tokens)` of a sequence for `layers`: `{k{i}|v{i}: [tokens, kv_heads, head_dim]}` (copies)."""
        self._check_layers(layers)
        self.check_block_table(block_table, tokens, "export_kv")
        return self.storage.gather(block_table, 0, tokens, layer_buffer_names(layers))

    def import_kv(self, block_table: Sequence[int], data: Mapping[str, torch.Tensor], start: int = 0) -> None:
        """Write what `export_kv` returned into tokens `[start, start + n)` of another block table."""
        if not data:
            return
        tokens = next(iter(data.values())).shape[0]
        self.check_block_table(block_table, start + tokens, "import_kv")
        self.storage.scatter(block_table, start, data)

    def export_blocks(self, block_ids: Sequence[int], layers: range) -> dict[str, torch.Tensor]:
        """Whole blocks, as a transport moves them: `{name: [len(block_ids), block_size, kv_heads, head_dim]}`."""
        self._check_layers(layers)
        self.check_block_table(block_ids, 0, "export_blocks")
        index = torch.as_tensor(list(block_ids), dtype=torch.int64, device=self.device)
        return {
            name: self.storage.tensors[name].index_select(0, index) for name in layer_buffer_names(layers)
        }

    def import_blocks(self, block_ids: Sequence[int], data: Mapping[str, torch.Tensor]) -> None:
        """Write whole blocks returned by `export_blocks` into `block_ids` (same count, same layout)."""
        self.check_block_table(block_ids, 0, "import_blocks")
        index = torch.as_tensor(list(block_ids), dtype=torch.int64, device=self.device)
        for name, blocks in data.items():
            target = self.storage.tensors[name]
            if blocks.shape[0] != len(block_ids) or blocks.shape[1:] != target.shape[1:]:
                raise InvalidBatchError(
                    f"import_blocks: buffer {name!r} got {list(blocks.shape)}, expected "
                    f"[{len(block_ids)}, {', '.join(str(d) for d in target.shape[1:])}]"
                )
            target.index_copy_(0, index, blocks.to(device=target.device, dtype=target.dtype))

    def slot_rows(self, block_table: Sequence[int], start: int, count: int) -> torch.Tensor:
        """Storage rows of tokens `[start, start + count)` of a sequence (int64, on the cache's device)."""
        return token_rows(block_table, self.block_size, start, count, self.device)

    def _check_layers(self, layers: range) -> None:
        if layers.step != 1 or layers.start < 0 or layers.stop > self.config.num_layers or len(layers) == 0:
            raise InvalidBatchError(
                f"layer range [{layers.start}, {layers.stop}) is not a non-empty part of "
                f"[0, {self.config.num_layers})"
            )
