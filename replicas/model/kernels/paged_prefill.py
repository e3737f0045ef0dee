"""Paged prefill attention: packed variable-length new tokens over their cached prefixes and themselves.

Grid `(cdiv(max_query_len, PREFILL_BLOCK_M), B, heads)`: a program takes `PREFILL_BLOCK_M` consecutive new
tokens of one sequence for one query head (a program past its sequence's new tokens returns at once). It
walks the context through the block table from position 0 up to its last token's position in tiles of
`context_tile(d)` positions with an online softmax (the pieces shared with `paged_decode`), masking
causally. The freshly written K/V are read back from the cache like the cached prefix, so an empty cache
(`cached_lens` all 0, the common case) and a cached prefix are the same path.

Batch invariance: a sequence's output is bitwise the same alone and in any batch. Query tiles start at
each sequence's own first new token, so which tokens share a tile and how far a tile walks depend on that
sequence alone; the tile sizes are constants (never derived from `max_query_len` or the batch, which size
the grid only); the walk order is fixed; no context is split across programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replicas.model.kernels.launch import LAUNCH_LOCK
from replicas.model.kernels.paged_decode import (
    NUM_STAGES,
    attention_scale,
    check_attention,
    context_rows,
    context_tile,
    head_tile,
    load_kv_tile,
    softmax_step,
)

PREFILL_BLOCK_M = 64  # new tokens of one sequence per program: a constant (batch invariance)
PREFILL_WARPS = 8  # a 64-row float32 tile and its accumulator over 4 warps would spill registers


@triton.jit
def _prefill_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    bt_ptr,
    starts_ptr,
    cached_ptr,
    out_ptr,
    scale,
    stride_qn,
    stride_qh,
    stride_kcr,
    stride_kch,
    stride_vcr,
    stride_vch,
    stride_btb,
    stride_on,
    HEAD_DIM,
    GROUP,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    kvh = head // GROUP
    q_start = tl.load(starts_ptr + b)
    q_len = tl.load(starts_ptr + b + 1) - q_start
    first = tile * BLOCK_M
    if first >= q_len:  # the grid covers the longest query; this sequence's new tokens end earlier
        return
    cached = tl.load(cached_ptr + b)
    i = first + tl.arange(0, BLOCK_M)
    dd = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    d_mask = dd < HEAD_DIM
    q_mask = (i < q_len)[:, None] & d_mask[None, :]
    token = (q_start + i).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qn + head * stride_qh + dd[None, :], mask=q_mask, other=0.0)
    q = q.to(tl.float32)
    query_pos = cached + i  # absolute positions of the tile's tokens (past q_len: masked on store)
    end = cached + tl.minimum(q_len, first + BLOCK_M)  # one past the tile's last token's position
    bt_row = bt_ptr + b * stride_btb
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, end, BLOCK_N):
        pos = start + n
        valid = pos < end
        rows = context_rows(bt_row, pos, valid, BLOCK_SIZE)
        k_t, v = load_kv_tile(
            kc_ptr, vc_ptr, rows, valid, dd, d_mask, kvh, stride_kcr, stride_kch, stride_vcr, stride_vch
        )
        visible = valid[None, :] & (pos[None, :] <= query_pos[:, None])
        m_i, l_i, acc = softmax_step(q, k_t, v, scale, visible, m_i, l_i, acc, IEEE)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out_offsets = token[:, None] * stride_on + head * HEAD_DIM + dd[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    cached_lens: torch.Tensor,
    *,
    max_query_len: int,
    block_size: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens over their cached prefixes and themselves; `[N, heads * d]`.

    `q` `[N, heads, d]` (last dimension contiguous) packs the new tokens of B sequences: sequence `b`'s
    are `q[query_starts[b]:query_starts[b + 1]]` (`query_starts` int32 `[B + 1]`, cumulative), and
    `cached_lens[b]` (int32 `[B]`) of its tokens were in the cache before them. Their K/V are already
    written; new token `i` of `b` attends to absolute positions `[0, cached_lens[b] + i]`, all read
    through `block_tables` (int32 `[B, max_blocks]`). `max_query_len` must be at least the longest
    sequence's new-token count (tokens past it are left unwritten: not checked, no value is read on the
    host); it sizes the grid only. The result is in q's dtype; `scale` defaults to `1 / sqrt(d)`.
    Batch-invariant (module docstring)."""
    n_tokens, heads, head_dim = q.shape
    kv_heads = check_attention(q, key_cache, value_cache, block_tables, "paged_prefill_attention")
    batch = block_tables.shape[0]
    if (
        query_starts.shape != (batch + 1,)
        or cached_lens.shape != (batch,)
        or not (query_starts.is_contiguous() and cached_lens.is_contiguous())
    ):
        raise ValueError(
            f"paged_prefill_attention: query_starts {list(query_starts.shape)} / cached_lens "
            f"{list(cached_lens.shape)} (contiguous) do not fit {batch} block tables"
        )
    out = torch.empty((n_tokens, heads * head_dim), dtype=q.dtype, device=q.device)
    if n_tokens == 0 or batch == 0 or max_query_len <= 0:
        return out
    block_d = head_tile(head_dim)
    grid = (triton.cdiv(max_query_len, PREFILL_BLOCK_M), batch, heads)
    with LAUNCH_LOCK:
        _prefill_kernel[grid](
            q,
            key_cache,
            value_cache,
            block_tables,
            query_starts,
            cached_lens,
            out,
            attention_scale(scale, head_dim),
            q.stride(0),
            q.stride(1),
            key_cache.stride(0),
            key_cache.stride(1),
            value_cache.stride(0),
            value_cache.stride(1),
            block_tables.stride(0),
            out.stride(0),
            head_dim,
            heads // kv_heads,
            BLOCK_SIZE=block_size,
            BLOCK_M=PREFILL_BLOCK_M,
            BLOCK_N=context_tile(block_d),
            BLOCK_D=block_d,
            IEEE=q.dtype == torch.float32,
            num_warps=PREFILL_WARPS,
            num_stages=NUM_STAGES,
        )
    return out
