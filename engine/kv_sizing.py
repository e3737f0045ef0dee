"""KV pool sizing on a CUDA device by `--gpu-memory-utilization` (vLLM's flag; docs/gpu.md#kv-pool-sizing).

`kv_budget` is the arithmetic alone, on plain numbers. `device_kv_settings` applies it to a node: the
device's `(free, total)` bytes as `torch.cuda.mem_get_info` reports them once the node's resident copy
of the weights is loaded (`NodeCore.start_replicas` reads them; tests pass numbers in), the model's KV
block bytes and the replicas' other device pools. In bytes:

    budget     = floor(total * utilization) - (total - free) - reserved
    per_kv     = budget // kv_replicas - fixed
    blocks     = min(per_kv // block_bytes, max_blocks)         (KV blocks per prefill/decode replica)

`total - free` is everything in use on the device at that moment, as the driver counts it: this
process's CUDA context, the loaded weights, whatever torch's caching allocator holds (in use or cached),
and every other process's memory on the device. `reserved` is what the replicas without a KV pool (encode)
put on the device, `fixed` what each prefill/decode replica puts there besides its KV blocks (its ZigZag
relay pool and its weight staging pool). Not counted: the activations and scratch of the forward passes
(and CUDA graphs), which come out of the `1 - utilization` the node leaves.

Invariants: the pools never exceed the budget (`kv_replicas * (blocks * block_bytes + fixed) + reserved
<= floor(total * utilization) - (total - free)`); more utilization never gives fewer blocks; a pool
has at most `MAX_BLOCKS` blocks (the cap of `--kv-pool-blocks`: a small model on a large device); a budget
that cannot hold `min_blocks` (one maximum-context sequence) per replica raises `KvBudgetError`.
Synchronous and pure; nothing to cancel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, final

import msgspec

from engine.config import MAX_BLOCKS, ConfigError, NodeConfig, ReplicaCounts
from replicas.loading.staging import BLOCK_BYTES as STAGING_BLOCK_BYTES
from replicas.model import ModelConfig
from replicas.model.kv_cache import kv_layout
from replicas.settings import ReplicaSettings
from replicas.zigzag.wire import relay_layout, relay_pool_blocks

GIB: Final = 1 << 30


@final
class KvBudgetError(ConfigError):
    """The memory `--gpu-memory-utilization` leaves cannot hold one maximum-context sequence per
    prefill/decode replica. `code`: `kv_budget_too_small`; the message names the bytes and the ways out."""

    code: Final = "kv_budget_too_small"


@final
@dataclass(frozen=True, slots=True)
class KvBudget:
    """What the sizing found: `blocks` per prefill/decode replica, out of `budget` bytes (after the
    memory `in_use` and the `reserved` bytes), of a device of `total` bytes."""

    blocks: int
    budget: int
    in_use: int
    total: int


def kv_budget(
    *,
    free: int,
    total: int,
    utilization: float,
    kv_replicas: int,
    block_bytes: int,
    fixed: int = 0,
    reserved: int = 0,
    min_blocks: int = 1,
    max_blocks: int = MAX_BLOCKS,
    where: str = "the device",
) -> KvBudget:
    """KV blocks per prefill/decode replica (see the module docstring for the formula and invariants).

    `free` and `total`: the device's bytes (`torch.cuda.mem_get_info`); `utilization` in (0, 1];
    `kv_replicas` (at least 1) share the budget equally, each paying `fixed` bytes besides its
    blocks of `block_bytes`, at most `max_blocks` (a pool's cap); `reserved` bytes come off the budget
    first. Raises `KvBudgetError` when a
    replica would get fewer than `min_blocks`; `where` names the device in its message."""
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization {utilization} is not in (0, 1]")
    if not 0 <= free <= total:
        raise ValueError(f"free {free} is not in [0, total {total}]")
    if kv_replicas < 1 or block_bytes < 1 or fixed < 0 or reserved < 0 or not 1 <= min_blocks <= max_blocks:
        raise ValueError(
            f"kv_replicas {kv_replicas}, block_bytes {block_bytes}, fixed {fixed}, reserved {reserved}, "
            f"min_blocks {min_blocks}, max_blocks {max_blocks}: out of range"
        )
    allowed = math.floor(total * utilization)
    in_use = total - free
    budget = allowed - in_use - reserved
    blocks = min(max(0, (budget // kv_replicas - fixed) // block_bytes), max_blocks) if budget > 0 else 0
    if blocks < min_blocks:
        needed = kv_replicas * (min_blocks * block_bytes + fixed) + reserved + in_use
        raise KvBudgetError(
            f"{KvBudgetError.code}: --gpu-memory-utilization {utilization} lets the node fill "
            f"{_gib(allowed)} of {where}'s {_gib(total)}, and {_gib(in_use)} is in use after loading the "
            f"weights, which leaves {_gib(max(budget, 0))} for the pools; {kv_replicas} prefill/decode "
            f"replica(s) need at least {min_blocks} KV blocks each (one maximum-context sequence) of "
            f"{block_bytes} bytes, plus {fixed} bytes of other pools each, {_gib(needed)} in all; raise "
            "--gpu-memory-utilization, start fewer replicas (--replicas), lower --max-model-len, or give "
            "--kv-pool-blocks"
        )
    return KvBudget(blocks=blocks, budget=budget, in_use=in_use, total=total)


def device_kv_settings(
    settings: ReplicaSettings,
    config: NodeConfig,
    model: ModelConfig,
    counts: ReplicaCounts,
    context: int,
    memory: tuple[int, int],
) -> tuple[ReplicaSettings, KvBudget]:
    """`settings` with `kv_pool_blocks` sized by `config.gpu_memory_utilization` from the device's
    `memory` (`(free, total)` bytes, read with the weights loaded), for the `counts` of replicas the node
    starts, each pool holding at least one `context`-token sequence. Needs a prefill or decode replica
    in `counts`. Raises `KvBudgetError`."""
    kv_replicas = counts.prefill + counts.decode
    assert kv_replicas > 0, "no prefill or decode replica: no KV pool to size"
    free, total = memory
    staging = settings.weights_pool_blocks * STAGING_BLOCK_BYTES
    relay = relay_layout(model)
    relay_bytes = relay_pool_blocks(settings.max_batch_tokens, relay.block_size) * relay.bytes_per_block
    block_size = settings.kv_block_size
    sized = kv_budget(
        free=free,
        total=total,
        utilization=config.gpu_memory_utilization,
        kv_replicas=kv_replicas,
        block_bytes=kv_layout(model, block_size).bytes_per_block,
        fixed=relay_bytes + staging,
        reserved=counts.encode * staging,
        min_blocks=-(-context // block_size),
        where=config.device,
    )
    return msgspec.structs.replace(settings, kv_pool_blocks=sized.blocks), sized


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB"
