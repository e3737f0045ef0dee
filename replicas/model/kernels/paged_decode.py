"""Paged decode attention (one query token per sequence) and the pieces the prefill kernel shares with it.

Grid `(B, kv_heads)`: a program takes the whole query group of one KV head of one sequence — the
`heads // kv_heads` query heads, padded to `max(16, next_pow2(group))` rows and masked — so each K/V tile
is read once per group and both products are `tl.dot`s. It walks the context from position 0 upwards in
tiles of `context_tile(d)` positions with an online softmax (flash attention); the context length is
loaded in the kernel, so the launch depends on shapes only and can be captured in a CUDA graph.

Batch invariance: a sequence's output is bitwise the same alone, in any batch, and beside padded rows.
One program per sequence and KV head, tile sizes that depend on head_dim alone, one fixed walk order,
and no split of a context across programs (no split-KV) make it so; changing any of these breaks it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from replicas.model.kernels.kv_write import check_cache
from replicas.model.kernels.launch import LAUNCH_LOCK

MIN_DOT = 16  # tl.dot needs at least 16 rows and columns
NUM_STAGES = 2  # software pipelining depth of the context loop (shared memory stays small for float32)
DECODE_WARPS = 4


def head_tile(head_dim: int) -> int:
    """The padded head dimension of the tiles (a power of two, at least `MIN_DOT`)."""
    return max(MIN_DOT, triton.next_power_of_2(head_dim))


def context_tile(block_d: int) -> int:
    """Context positions per tile: 64 up to head_dim 64, 32 at 128, 16 beyond (a float32 K tile stays
    16 KiB, which keeps registers and shared memory in bounds). A function of head_dim alone, never of a
    batch or a length (batch invariance)."""
    return max(MIN_DOT, min(64, 4096 // block_d))


def attention_scale(scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """`a @ b` of float32 tiles: IEEE float32 for a float32 model, TF32 for a 16-bit one (a bfloat16 or
    float16 value is a TF32 value, so Q·Kᵀ stays exact; P keeps 10 mantissa bits)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision="tf32")


@triton.jit
def context_rows(bt_row_ptr, pos, valid, BLOCK_SIZE: tl.constexpr):
    """Cache rows (int64) of positions `pos` of the sequence whose block table starts at `bt_row_ptr`;
    the table is read for `valid` positions only."""
    block = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return block * BLOCK_SIZE + pos % BLOCK_SIZE


@triton.jit
def load_kv_tile(
    kc_ptr, vc_ptr, rows, valid, dd, d_mask, kvh, stride_kcr, stride_kch, stride_vcr, stride_vch
):
    """KV head `kvh`'s keys (transposed, `[D, N]`) and values (`[N, D]`) at cache `rows`, as float32;
    zeros where `valid` or `d_mask` is false."""
    k_mask = valid[None, :] & d_mask[:, None]
    v_mask = valid[:, None] & d_mask[None, :]
    k_t = tl.load(
        kc_ptr + rows[None, :] * stride_kcr + kvh * stride_kch + dd[:, None], mask=k_mask, other=0.0
    )
    v = tl.load(vc_ptr + rows[:, None] * stride_vcr + kvh * stride_vch + dd[None, :], mask=v_mask, other=0.0)
    return k_t.to(tl.float32), v.to(tl.float32)


@triton.jit
def softmax_step(q, k_t, v, scale, visible, m_i, l_i, acc, IEEE: tl.constexpr):
    """Fold one context tile (`k_t` `[D, N]`, `v` `[N, D]`, float32) into the running maximum `m_i`, sum
    `l_i` and output `acc` of the query rows `q` `[M, D]`; `visible` `[M, N]` masks scores out.

    A row that has seen no visible position keeps `m_i = -inf`, `l_i = 0` (`m_safe` avoids `-inf - -inf`)."""
    s = dot(q, k_t, IEEE) * scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot(p, v, IEEE)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    bt_ptr,
    lens_ptr,
    out_ptr,
    scale,
    stride_qb,
    stride_qh,
    stride_kcr,
    stride_kch,
    stride_vcr,
    stride_vch,
    stride_btb,
    stride_ob,
    HEAD_DIM,
    GROUP,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    dd = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    d_mask = dd < HEAD_DIM
    q_mask = (g < GROUP)[:, None] & d_mask[None, :]
    head = kvh * GROUP + g
    q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + dd[None, :], mask=q_mask, other=0.0)
    q = q.to(tl.float32)
    context = tl.load(lens_ptr + b)
    bt_row = bt_ptr + b * stride_btb
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(0, context, BLOCK_N):
        pos = start + n
        valid = pos < context
        rows = context_rows(bt_row, pos, valid, BLOCK_SIZE)
        k_t, v = load_kv_tile(
            kc_ptr, vc_ptr, rows, valid, dd, d_mask, kvh, stride_kcr, stride_kch, stride_vcr, stride_vch
        )
        m_i, l_i, acc = softmax_step(q, k_t, v, scale, valid[None, :], m_i, l_i, acc, IEEE)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # no context (a padded row): zeros
    out_offsets = b * stride_ob + head[:, None] * HEAD_DIM + dd[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    block_size: int,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its cached context; returns `[B, heads * d]`.

    `q` `[B, heads, d]` (last dimension contiguous); `key_cache`/`value_cache` `[rows, kv_heads, d]` in
    q's dtype; `block_tables` int32 `[B, max_blocks]` (entries past a sequence's blocks are never read);
    `context_lens` int32 `[B]`: row `b` attends to positions `[0, context_lens[b])`, the new token's K/V
    already written, and `context_lens[b] <= max_blocks * block_size` (not checked: no value is read on
    the host). `context_lens[b] == 0` (a padded row) gives zeros. The result, in q's dtype, is written
    into `out` (contiguous `[B, heads * d]`) when given. `scale` defaults to `1 / sqrt(d)`.
    Batch-invariant and graph-capturable (module docstring)."""
    batch, heads, head_dim = q.shape
    kv_heads = check_attention(q, key_cache, value_cache, block_tables, "paged_decode_attention")
    if context_lens.shape != (batch,) or not context_lens.is_contiguous() or block_tables.shape[0] != batch:
        raise ValueError(
            f"paged_decode_attention: context_lens {list(context_lens.shape)} (contiguous) / block_tables "
            f"{list(block_tables.shape)} do not fit a batch of {batch}"
        )
    if out is None:
        out = torch.empty((batch, heads * head_dim), dtype=q.dtype, device=q.device)
    elif out.shape != (batch, heads * head_dim) or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(
            f"paged_decode_attention: out must be a contiguous {q.dtype} [{batch}, {heads * head_dim}]"
        )
    if batch == 0:
        return out
    group = heads // kv_heads
    block_d = head_tile(head_dim)
    with LAUNCH_LOCK:
        _decode_kernel[(batch, kv_heads)](
            q,
            key_cache,
            value_cache,
            block_tables,
            context_lens,
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
            group,
            BLOCK_SIZE=block_size,
            BLOCK_G=max(MIN_DOT, triton.next_power_of_2(group)),
            BLOCK_N=context_tile(block_d),
            BLOCK_D=block_d,
            IEEE=q.dtype == torch.float32,
            num_warps=DECODE_WARPS,
            num_stages=NUM_STAGES,
        )
    return out


def check_attention(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor, what: str
) -> int:
    """Shape checks shared by decode and prefill (shapes only: no value is read); returns kv_heads."""
    check_cache(key_cache, value_cache, what)
    if q.dim() != 3 or q.stride(2) != 1 or q.dtype != key_cache.dtype or q.shape[2] != key_cache.shape[2]:
        raise ValueError(
            f"{what}: q {q.dtype} {list(q.shape)} (last dimension contiguous) does not fit the cache "
            f"{key_cache.dtype} {list(key_cache.shape)}"
        )
    if q.device != key_cache.device or block_tables.device != q.device:
        raise ValueError(f"{what}: q, the caches and block_tables must be on one device")
    heads, kv_heads = q.shape[1], key_cache.shape[1]
    if heads % kv_heads != 0:
        raise ValueError(f"{what}: {heads} query heads are not a multiple of {kv_heads} KV heads")
    if block_tables.dim() != 2 or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{what}: block_tables must be int32 [B, max_blocks], got {block_tables.dtype} {list(block_tables.shape)}"
        )
    if not block_tables.is_contiguous():
        raise ValueError(f"{what}: block_tables must be contiguous")
    return int(kv_heads)
