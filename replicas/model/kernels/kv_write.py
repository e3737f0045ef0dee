"""The KV write: the new tokens' keys and values copied into their cache rows, one Triton program a token.

A token's row is its *slot* (`block_id * block_size + offset`, the layout of `replicas/model/kv_cache.py`);
a negative slot marks a padded row of a CUDA-graph batch and is skipped. The launch's grid is `(N,)` and no
tensor value is read on the host, so the call can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replicas.model.kernels.launch import LAUNCH_LOCK


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slots_ptr,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_kcr,
    stride_kch,
    stride_vcr,
    stride_vch,
    KV_HEADS,
    HEAD_DIM,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    if slot >= 0:
        hh = tl.arange(0, BLOCK_H)[:, None]
        dd = tl.arange(0, BLOCK_D)[None, :]
        mask = (hh < KV_HEADS) & (dd < HEAD_DIM)
        key = tl.load(k_ptr + i * stride_kn + hh * stride_kh + dd, mask=mask)
        value = tl.load(v_ptr + i * stride_vn + hh * stride_vh + dd, mask=mask)
        tl.store(kc_ptr + slot * stride_kcr + hh * stride_kch + dd, key, mask=mask)
        tl.store(vc_ptr + slot * stride_vcr + hh * stride_vch + dd, value, mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Copy `key`/`value` `[N, kv_heads, d]` into rows `slots[i]` of `key_cache`/`value_cache`
    (`[rows, kv_heads, d]`, the same dtype and device), in place.

    `slots` is int32 or int64 `[N]`; a negative slot is skipped. A slot must be below `rows` (not checked:
    that would read it on the host), and two tokens may not share a valid slot (which write wins is then
    undefined). `key`/`value` may be strided views (e.g. slices of a fused QKV projection) as long as their
    last dimension is contiguous. Graph-capturable: the grid is `(N,)`."""
    check_cache(key_cache, value_cache, "write_kv")
    n_tokens = key.shape[0]
    if key.dim() != 3 or key.shape != value.shape or key.shape[1:] != key_cache.shape[1:]:
        raise ValueError(
            f"write_kv: key {list(key.shape)} / value {list(value.shape)} do not fit a cache of "
            f"{list(key_cache.shape)}"
        )
    if key.dtype != key_cache.dtype or value.dtype != key_cache.dtype or key.device != key_cache.device:
        raise ValueError(
            f"write_kv: key/value {key.dtype}/{value.dtype} on {key.device}, cache {key_cache.dtype} on "
            f"{key_cache.device}"
        )
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("write_kv: key and value need a contiguous last dimension")
    if slots.shape != (n_tokens,) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"write_kv: slots must be int32/int64 [{n_tokens}], got {slots.dtype} {list(slots.shape)}"
        )
    if n_tokens == 0:
        return
    kv_heads, head_dim = key.shape[1], key.shape[2]
    with LAUNCH_LOCK:
        _write_kv_kernel[(n_tokens,)](
            key,
            value,
            key_cache,
            value_cache,
            slots,
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            key_cache.stride(0),
            key_cache.stride(1),
            value_cache.stride(0),
            value_cache.stride(1),
            kv_heads,
            head_dim,
            BLOCK_H=triton.next_power_of_2(kv_heads),
            BLOCK_D=triton.next_power_of_2(head_dim),
        )


def check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor, what: str) -> None:
    """Raise `ValueError` unless the caches are two equal `[rows, kv_heads, d]` tensors with a contiguous
    last dimension (shapes only: no value is read)."""
    if key_cache.dim() != 3 or key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise ValueError(
            f"{what}: key cache {key_cache.dtype} {list(key_cache.shape)} and value cache "
            f"{value_cache.dtype} {list(value_cache.shape)} must be alike, [rows, kv_heads, d]"
        )
    if key_cache.stride(2) != 1 or value_cache.stride(2) != 1:
        raise ValueError(f"{what}: the key and value caches need a contiguous last dimension")
