"""Prefill attention on the kernels: packed variable-length sequences, cached prefixes read in place.

`plan_kernel_prefill` builds, once per executor call, the device tensors every layer reuses (the new
tokens' cache rows, the block tables, where each sequence's tokens start in the packed batch, how many
tokens each had cached); `kernel_prefill_attention` writes a layer's new K/V (`write_kv`) and runs
`paged_prefill_attention` over the whole batch in one launch — no loop over sequences, no gathered
context, whatever the mix of lengths and prefixes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, final

import torch

if TYPE_CHECKING:
    from replicas.model.attention import SequenceSpan
    from replicas.model.kv_cache import KVCache


@final
@dataclass(frozen=True, slots=True)
class KernelPrefillPlan:
    slots: torch.Tensor  # int64 [N]: the cache row of each new token
    block_tables: torch.Tensor  # int32 [B, widest table]
    query_starts: torch.Tensor  # int32 [B + 1]
    cached_lens: torch.Tensor  # int32 [B]
    max_query_len: int


def plan_kernel_prefill(cache: KVCache, spans: Sequence[SequenceSpan]) -> KernelPrefillPlan:
    """The plan of one prefill call (host lists → one copy per tensor)."""
    device = cache.device
    slots = torch.cat([cache.slot_rows(s.block_table, s.cached_tokens, s.new_tokens) for s in spans])
    width = max(cache.blocks_for(s.cached_tokens + s.new_tokens) for s in spans)
    tables = [list(s.block_table[:width]) + [0] * (width - len(s.block_table[:width])) for s in spans]
    starts = [0]
    for span in spans:
        starts.append(starts[-1] + span.new_tokens)
    return KernelPrefillPlan(
        slots=slots,
        block_tables=torch.tensor(tables, dtype=torch.int32).to(device, non_blocking=True),
        query_starts=torch.tensor(starts, dtype=torch.int32).to(device, non_blocking=True),
        cached_lens=torch.tensor([s.cached_tokens for s in spans], dtype=torch.int32).to(
            device, non_blocking=True
        ),
        max_query_len=max(s.new_tokens for s in spans),
    )


def kernel_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int, plan: KernelPrefillPlan
) -> torch.Tensor:
    """`q` `[N, heads, d]`, `k`/`v` `[N, kv_heads, d]` (the packed new tokens) → `[N, heads * d]`."""
    from replicas.model.kernels.paged_attention import paged_prefill_attention, write_kv

    keys, values = cache.keys(layer), cache.values(layer)
    write_kv(k, v, keys, values, plan.slots)
    return paged_prefill_attention(
        q,
        keys,
        values,
        plan.block_tables,
        plan.query_starts,
        plan.cached_lens,
        max_query_len=plan.max_query_len,
        block_size=cache.block_size,
    )
