"""Batch-invariant matmul (with bias and residual add) and RMSNorm in Triton.

On a GPU, torch's matmul (cuBLAS) picks its kernel by the shape — for few rows a split-K kernel that
sums partial products over K in another order — and torch's reductions pick their strategy by the
tensor's shape. So the logits of one sequence depend, in their last bits, on which and how many other
sequences share its batch. The kernels here make row i of each result a function of row i of the inputs
alone, bitwise, for any number of rows M and whatever the other rows hold (the `--batch-invariant` mode of
vLLM and SGLang does the same):

- `invariant_linear`: one fixed tile configuration (`BLOCK_M`, `BLOCK_N`, `BLOCK_K`, `NUM_WARPS`,
  `NUM_STAGES` below; no autotuning, no split-K), so every output element is accumulated in float32 over
  K in the same `BLOCK_K` steps in the same order, whatever M is. The row count is a run-time argument
  that Triton does not specialize on (`do_not_specialize`), so M = 1 or M divisible by 16 compiles to the
  same code as any other M. Rows past M are masked loads (zeros) that cannot reach a real row: in a
  matrix product each output row reads only its own input row.
- `invariant_rms_norm`: one program per row, the hidden size looped in fixed chunks whose size and
  reduction tree depend on the hidden size only.

The cost: without split-K a product with few rows (decode) launches only `cdiv(N, BLOCK_N)` programs,
each looping over all of K, so on a GPU it is slower than cuBLAS's split-K kernels for small M; and a
single configuration is not the fastest one for every shape. How much slower is measured by the bench,
not here. Equality to torch is not a goal (torch's own results change with the batch); the tests check
closeness to torch and bitwise invariance.

Works with Triton 3.6 and later (basic `tl` ops only) and in Triton's interpreter (`TRITON_INTERPRET=1`)
on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replicas.model.kernels.launch import LAUNCH_LOCK, interpreting

__all__ = ["invariant_linear", "invariant_rms_norm"]

# The one tile configuration of `invariant_linear`, for every M, N, K and dtype. 64 x 64 output tiles
# over 64-wide K steps: at most 3 stages x 2 tiles x 64 x 64 x 4 bytes = 96 KiB of shared memory in
# float32 (48 KiB in bfloat16), which fits on A100 / H100-class GPUs.
BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 64
NUM_WARPS = 4
NUM_STAGES = 3

# `invariant_rms_norm` processes a row in chunks of min(next_power_of_2(H), RMS_MAX_BLOCK) elements.
RMS_MAX_BLOCK = 4096


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    r_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_rm,
    stride_rn,
    stride_om,
    stride_on,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    IEEE: tl.constexpr,
    FIXED_ORDER: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # int64 row / column offsets: M x N logits or an N x K vocabulary matrix may pass 2**31 elements.
    offs_m = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    offs_n = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    offs_k = tl.arange(0, BK)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # x tile [BM, BK]; the weight is [N, K] row-major, read transposed by its strides as a [BK, BN] tile.
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    # The same K steps in the same order for every M: each output element sums over K identically.
    for k0 in range(0, K, BK):
        mask_k = offs_k < K - k0
        a = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if FIXED_ORDER:  # the interpreter: each product summed over this K step in k's order (see below)
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        elif IEEE:  # float32 inputs: full-precision products (a GPU would use TF32 by default)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:  # 16-bit inputs: exact products, float32 accumulation
            acc = tl.dot(a, b, acc)
        x_ptrs += BK * stride_xk
        w_ptrs += BK * stride_wk
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if HAS_RESIDUAL:
        r_ptrs = r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :] * stride_rn
        residual = tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
        acc = residual + acc
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# Under `TRITON_INTERPRET=1` `triton.jit` makes an `InterpretedFunction`, whose `tl.dot` is numpy's matmul:
# the BLAS behind it picks its kernel by the tile's shape and by the CPU (AVX2, AVX-512, its core type), and
# a row's sum over K may be ordered by where the row sits in the tile. So under the interpreter the kernel
# sums each K step itself: the products of a [BM, BK] and a [BK, BN] tile, widened to float32 (a product of
# two bfloat16 values is exact in float32, as on tensor cores; the interpreter's `tl.dot` would multiply
# bfloat16 tiles as the raw 16-bit integers it stores them in), reduced over K by numpy's `sum(axis=1)`,
# whose order for an output element depends on BK alone — never on the row, the batch, the BLAS or the
# machine. On a GPU the compiled `tl.dot` runs, and its invariance is the GPU test's to show.
_FIXED_ORDER = interpreting()


def invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias [N]) (+ residual [M, N]) → [M, N] in x's dtype. Row i of the
    result depends only on x[i] (and residual[i]): bitwise the same for any M and any other rows.
    When `residual` is given the result is written into it in place and it is returned.

    One fixed tile configuration (`BLOCK_M` x `BLOCK_N` tiles, `BLOCK_K` steps over K, no split-K), so each
    output element is accumulated in float32 over K in the same order whatever M is. Rounding: the
    products are accumulated in float32 (float32 inputs with full-precision products, not TF32); the bias
    is added in float32 (`acc + bias`, one float32 rounding), then the residual in float32
    (`residual + (acc + bias)`, one more), and the sum is rounded to x's dtype once, at the store. So in
    bfloat16 there is a single rounding to bfloat16 per element, where torch's `residual + F.linear(x, W, b)`
    rounds the product to bfloat16 before the add (and `Linear.add_to` rounds again after the bias): the
    results are close to torch's, not equal to them, and never depend on the batch.

    The cost: no split-K, so for small M (decode) only `cdiv(N, BLOCK_N)` programs run, each over all of K
    — slower than cuBLAS on a GPU for few rows.

    `weight` must have x's dtype (float32, float16 or bfloat16); `bias` may be any float dtype; `residual`
    must have x's dtype and must not overlap x (programs of one row tile write their columns of it while
    the others still read x's row). Any strides work: the weight is read transposed by its strides,
    nothing is copied.
    """
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"invariant_linear expects x [M, K] and weight [N, K], got {x.shape} and {weight.shape}"
        )
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} features, weight {tuple(weight.shape)} expects {weight.shape[1]}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"invariant_linear supports float32, float16 and bfloat16, not {x.dtype}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if residual is not None:
        if residual.shape != (m, n):
            raise ValueError(f"residual must be [{m}, {n}], got {tuple(residual.shape)}")
        if residual.dtype != x.dtype:
            raise ValueError(f"residual dtype {residual.dtype} differs from x dtype {x.dtype}")
        out = residual
    else:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:  # nothing to accumulate: the bias and the residual alone
        out.copy_(_empty_product(out, bias, residual))
        return out
    # Unused pointers get a valid tensor; the constexpr flags keep them from being read.
    b_arg = bias if bias is not None else out
    r_arg = residual if residual is not None else out
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    with LAUNCH_LOCK:
        _linear_kernel[grid](
            x,
            weight,
            b_arg,
            r_arg,
            out,
            m,
            n,
            k,
            x.stride(0),
            x.stride(1),
            weight.stride(0),
            weight.stride(1),
            r_arg.stride(0),
            r_arg.stride(1),
            out.stride(0),
            out.stride(1),
            HAS_BIAS=bias is not None,
            HAS_RESIDUAL=residual is not None,
            IEEE=x.dtype == torch.float32,
            FIXED_ORDER=_FIXED_ORDER,
            BM=BLOCK_M,
            BN=BLOCK_N,
            BK=BLOCK_K,
            num_warps=NUM_WARPS,
            num_stages=NUM_STAGES,
        )
    return out


def _empty_product(
    out: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None
) -> torch.Tensor:
    """The result for K = 0 (an empty sum): bias + residual in float32, elementwise (row-invariant)."""
    total = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    if bias is not None:
        total += bias.to(torch.float32)
    if residual is not None:
        total = residual.to(torch.float32) + total
    return total.to(out.dtype)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    H,
    stride_xm,
    stride_om,
    eps,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    out_row = out_ptr + row * stride_om
    offs = tl.arange(0, BLOCK)
    # Sum of squares in float32: elementwise over the chunks in order, then one tree sum whose shape
    # depends on BLOCK (fixed by H) only.
    sq = tl.zeros((BLOCK,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK):
        mask = offs < H - h0
        v = tl.load(x_row + h0 + offs, mask=mask, other=0.0).to(tl.float32)
        sq += v * v
    mean = tl.sum(sq, axis=0) / H
    rstd = 1.0 / tl.sqrt_rn(mean + eps)
    for h0 in range(0, H, BLOCK):
        mask = offs < H - h0
        v = tl.load(x_row + h0 + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + h0 + offs, mask=mask, other=0.0)
        normed = v * rstd
        if CAST_BEFORE_WEIGHT:  # as `rms_norm`: the normalized row is rounded to x's dtype before the weight
            normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
        y = normed * w.to(tl.float32)
        tl.store(out_row + h0 + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [M, H], computed as `rms_norm` in replicas/model/layers.py does
    (float32 statistics, cast to x's dtype before multiplying by `weight`), one program per row with a
    fixed reduction order: row i's result does not depend on M or the other rows.

    `weight * (x32 * rsqrt(mean(x32²) + eps)).to(x.dtype)`; the product with the weight is computed in
    float32 and rounded once to the result dtype (torch's promotion of x's and weight's dtypes, as in
    `rms_norm`). The row is read in chunks of min(next_power_of_2(H), `RMS_MAX_BLOCK`) elements; the sum
    of squares adds the chunks elementwise in order and then sums one chunk-sized vector, an order fixed
    by H alone. Close to torch's `rms_norm`, whose reduction order is not the same (nor batch-invariant).

    The cost: one program per row, so few rows use few of a GPU's cores (RMSNorm is a small part of a
    layer's time).
    """
    if x.dim() != 2 or weight.dim() != 1 or weight.shape[0] != x.shape[1]:
        raise ValueError(
            f"invariant_rms_norm expects x [M, H] and weight [H], got {x.shape} and {weight.shape}"
        )
    m, h = x.shape
    out = torch.empty((m, h), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if m == 0 or h == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(0) != 1:
        weight = weight.contiguous()
    block = min(triton.next_power_of_2(h), RMS_MAX_BLOCK)
    with LAUNCH_LOCK:
        _rms_norm_kernel[(m,)](
            x,
            weight,
            out,
            h,
            x.stride(0),
            out.stride(0),
            float(eps),
            CAST_BEFORE_WEIGHT=x.dtype != torch.float32,
            BLOCK=block,
            num_warps=4 if block <= 1024 else 8,
        )
    return out
