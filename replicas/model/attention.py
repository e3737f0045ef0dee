"""Paged attention: K/V are written to and read from the cache through each sequence's block table.

A *plan* is built once per executor call (storage rows of the new tokens, the rows of each context,
masks) and reused by every layer, so a layer costs one `index_copy_` per K and V, one vectorised gather
(decode) and one `scaled_dot_product_attention` call — never a Python loop per token.

Prefill: when every sequence starts from an empty cache and all have the same length, the whole batch is
one causal SDPA call on the freshly computed K/V. Otherwise each sequence gets its own call (a loop over
sequences per layer); a sequence with tokens already cached reads its whole context back through its
block table. Decode: one query token per sequence; the context rows of all sequences are gathered into
`[batch, longest, kv_heads, head_dim]` (short ones padded with their own newest row and masked out), and
the query heads are grouped per KV head so no K/V repetition is materialised.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import final

import torch
import torch.nn.functional as F

from replicas.model.kv_cache import KVCache


def avoid_cudnn_attention(device: torch.device) -> None:
    """On CUDA, turn off cuDNN's SDPA backend, for the process: torch picks it for 16-bit inputs on recent
    GPUs, and it builds an execution plan for every new shape — a decode step's context grows by a token
    each step, so every call paid for one (the tiny model's decode step in bfloat16, measured on an H100
    80GB HBM3: 56 ms, against 2 ms in float32). The flash and memory-efficient kernels run instead.
    Idempotent."""
    if device.type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)


@final
@dataclass(frozen=True, slots=True)
class SequenceSpan:
    """One sequence of a prefill call: `new_tokens` tokens written after `cached_tokens` cached ones."""

    block_table: Sequence[int]
    cached_tokens: int
    new_tokens: int


@final
@dataclass(frozen=True, slots=True)
class PrefillPlan:
    slots: torch.Tensor
    lengths: tuple[int, ...]
    uniform: bool
    context_rows: tuple[torch.Tensor | None, ...]
    masks: tuple[torch.Tensor | None, ...]


@final
@dataclass(frozen=True, slots=True)
class DecodePlan:
    slots: torch.Tensor
    rows: torch.Tensor
    width: int
    mask: torch.Tensor | None


def plan_prefill(cache: KVCache, spans: Sequence[SequenceSpan]) -> PrefillPlan:
    device = cache.device
    slots = torch.cat([cache.slot_rows(s.block_table, s.cached_tokens, s.new_tokens) for s in spans])
    lengths = tuple(s.new_tokens for s in spans)
    uniform = all(s.cached_tokens == 0 for s in spans) and len(set(lengths)) == 1
    context_rows: list[torch.Tensor | None] = []
    masks: list[torch.Tensor | None] = []
    for span in spans:
        if span.cached_tokens == 0:
            context_rows.append(None)
            masks.append(None)
            continue
        total = span.cached_tokens + span.new_tokens
        context_rows.append(cache.slot_rows(span.block_table, 0, total))
        query_index = torch.arange(span.cached_tokens, total, device=device)
        key_index = torch.arange(total, device=device)
        masks.append(key_index[None, :] <= query_index[:, None])
    return PrefillPlan(
        slots=slots, lengths=lengths, uniform=uniform, context_rows=tuple(context_rows), masks=tuple(masks)
    )


def plan_decode(
    cache: KVCache, block_tables: Sequence[Sequence[int]], cached_tokens: Sequence[int]
) -> DecodePlan:
    """Each sequence feeds one token at index `cached_tokens[b]` and attends to `[0, cached_tokens[b]]`."""
    bs = cache.block_size
    slots_list = [table[c // bs] * bs + c % bs for table, c in zip(block_tables, cached_tokens, strict=True)]
    longest = max(cached_tokens) + 1
    blocks_wide = -(-longest // bs)
    table = torch.tensor(
        [list(t[:blocks_wide]) + [0] * (blocks_wide - len(t[:blocks_wide])) for t in block_tables],
        dtype=torch.int64,
    )
    slots = torch.tensor(slots_list, dtype=torch.int64)
    position = torch.arange(longest, dtype=torch.int64)
    rows = table[:, position // bs] * bs + position % bs
    mask = None
    if len(set(cached_tokens)) > 1:
        visible = position[None, :] <= torch.tensor(list(cached_tokens), dtype=torch.int64)[:, None]
        rows = torch.where(visible, rows, slots[:, None])
        mask = visible.view(len(slots_list), 1, 1, longest).to(cache.device)
    return DecodePlan(
        slots=slots.to(cache.device), rows=rows.reshape(-1).to(cache.device), width=longest, mask=mask
    )


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int, plan: PrefillPlan
) -> torch.Tensor:
    """`q` `[N, heads, d]`, `k`/`v` `[N, kv_heads, d]` for the packed new tokens; returns `[N, heads * d]`."""
    key_cache, value_cache = cache.keys(layer), cache.values(layer)
    key_cache.index_copy_(0, plan.slots, k)
    value_cache.index_copy_(0, plan.slots, v)
    n_tokens, heads, head_dim = q.shape
    gqa = k.shape[1] != heads
    if plan.uniform:
        batch = len(plan.lengths)
        length = plan.lengths[0]
        out = F.scaled_dot_product_attention(
            q.view(batch, length, heads, head_dim).transpose(1, 2),
            k.view(batch, length, -1, head_dim).transpose(1, 2),
            v.view(batch, length, -1, head_dim).transpose(1, 2),
            is_causal=True,
            enable_gqa=gqa,
        )
        return out.transpose(1, 2).reshape(n_tokens, heads * head_dim)
    outputs = []
    start = 0
    for length, rows, mask in zip(plan.lengths, plan.context_rows, plan.masks, strict=True):
        stop = start + length
        query = q[start:stop].transpose(0, 1).unsqueeze(0)
        if rows is None:
            keys, values = k[start:stop], v[start:stop]
        else:
            keys, values = key_cache.index_select(0, rows), value_cache.index_select(0, rows)
        out = F.scaled_dot_product_attention(
            query,
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=gqa,
        )
        outputs.append(out[0].transpose(0, 1).reshape(length, heads * head_dim))
        start = stop
    return torch.cat(outputs)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int, plan: DecodePlan
) -> torch.Tensor:
    """`q` `[B, heads, d]`, `k`/`v` `[B, kv_heads, d]` (one new token each); returns `[B, heads * d]`."""
    key_cache, value_cache = cache.keys(layer), cache.values(layer)
    key_cache.index_copy_(0, plan.slots, k)
    value_cache.index_copy_(0, plan.slots, v)
    batch, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    width = plan.width
    keys = key_cache.index_select(0, plan.rows).view(batch, width, kv_heads, head_dim).transpose(1, 2)
    values = value_cache.index_select(0, plan.rows).view(batch, width, kv_heads, head_dim).transpose(1, 2)
    # Query heads h = g * group .. g * group + group - 1 share KV head g: they become g's "query rows".
    grouped = q.view(batch, kv_heads, heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=plan.mask)
    return out.reshape(batch, heads * head_dim)
