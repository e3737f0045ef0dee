"""Rotary embedding in one launch: what `replicas.model.rope.apply_rotary` does in five torch ops.

`rotary(x, cos, sin)`: `x` `[N, heads, d]` (any strides with a contiguous last dimension — the q or k
part of the fused projection's output), `cos`/`sin` `[N, d // 2]` in x's dtype → a new contiguous
`[N, heads, d]`: first half `x1·c − x2·s`, second half `x2·c + x1·s`, with torch's rounding steps
(`x1·c` is rounded to x's dtype before `x2·s` is subtracted in float32, as `mul` then `addcmul_` do);
whether a compiler fuses the last multiply-add may differ, so it equals `apply_rotary` to rounding. Grid:
one program per token, all its heads at once. Elementwise per token: batch-invariant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replicas.model.kernels.launch import LAUNCH_LOCK


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    heads,
    half,
    stride_xn,
    stride_xh,
    stride_cn,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    mask = (h < heads)[:, None] & (j < half)[None, :]
    c = tl.load(cos_ptr + token * stride_cn + j, mask=j < half, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + token * stride_cn + j, mask=j < half, other=0.0).to(tl.float32)[None, :]
    row = x_ptr + token * stride_xn + h[:, None] * stride_xh + j[None, :]
    x1 = tl.load(row, mask=mask, other=0.0)
    x2 = tl.load(row + half, mask=mask, other=0.0)
    dtype = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    first = (x1 * c).to(dtype).to(tl.float32) - x2 * s
    second = (x2 * c).to(dtype).to(tl.float32) + x1 * s
    out = out_ptr + token * heads * 2 * half + h[:, None] * 2 * half + j[None, :]
    tl.store(out, first.to(dtype), mask=mask)
    tl.store(out + half, second.to(dtype), mask=mask)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """See the module docstring. Raises `ValueError` on shapes or dtypes that do not fit."""
    if x.dim() != 3 or x.shape[-1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"rotary: x must be [N, heads, d] with an even, contiguous d; got {list(x.shape)}")
    n, heads, dim = x.shape
    half = dim // 2
    if list(cos.shape) != [n, half] or cos.shape != sin.shape or cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise ValueError(
            f"rotary: cos and sin must be [{n}, {half}] in {x.dtype}; got {list(cos.shape)} {cos.dtype}, "
            f"{list(sin.shape)} {sin.dtype}"
        )
    out = torch.empty((n, heads, dim), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    cos, sin = cos.contiguous(), sin.contiguous()
    with LAUNCH_LOCK:
        _rotary_kernel[(n,)](
            x,
            cos,
            sin,
            out,
            heads,
            half,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            BLOCK_H=triton.next_power_of_2(heads),
            BLOCK_HALF=triton.next_power_of_2(half),
        )
    return out
