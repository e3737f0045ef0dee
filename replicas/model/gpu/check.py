"""The kernels' check at start-up: do they run here, and do they agree with torch on this model's shapes?

`kernels_problem` runs the KV write, decode and prefill attention, RMSNorm and rotary kernels (and, for
a batch-invariant model, the invariant matmul) once on small random inputs with the model's head shape
and dtype, against torch computed in float32 from the same inputs. It returns None when they agree,
else a sentence saying why they cannot serve (Triton missing, a compile error, a wrong result) — the
executor then runs torch's path and logs the sentence. Results are cached per (device, dtype, shape): a node with
several replicas checks once.

Thread safety: may run in several worker threads at once; the cache is a dict written with whole values
(a race only repeats a check).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# Largest difference from float32 torch accepted, per dtype (relative to the largest output value).
_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
_checked: dict[tuple[str, torch.dtype, int, int, int, bool], str | None] = {}


def kernels_problem(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, *, invariant: bool
) -> str | None:
    """None when the kernels serve this shape on `device`; otherwise why not (see the module docstring)."""
    key = (str(device), dtype, heads, kv_heads, head_dim, invariant)
    if key not in _checked:
        _checked[key] = _check(device, dtype, heads, kv_heads, head_dim, invariant)
    return _checked[key]


def _check(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, invariant: bool
) -> str | None:
    try:
        import replicas.model.kernels.paged_attention  # noqa: F401 - imports Triton
        from replicas.model.kernels.launch import interpreting
    except ImportError as exc:
        return f"the attention kernels need Triton, which does not import here: {exc}"
    if device.type == "cpu" and not interpreting():
        return (
            "the Triton kernels run on CPU tensors only in Triton's interpreter (TRITON_INTERPRET=1, for "
            "tests); on cpu use --attention auto or torch"
        )
    try:
        problem = _attention(device, dtype, heads, kv_heads, head_dim)
        if problem is None:
            problem = _layer_ops(device, dtype, heads, head_dim, invariant=invariant)
    except Exception as exc:  # noqa: BLE001 - any failure of a kernel here means "do not use it"; it is reported
        return f"the kernels failed their check on {device} ({dtype}): {type(exc).__name__}: {exc}"
    return problem


def _close(got: torch.Tensor, want: torch.Tensor, what: str, dtype: torch.dtype) -> str | None:
    scale = max(float(want.abs().max()), 1e-6)
    worst = float((got.float() - want).abs().max()) / scale
    if not worst <= _TOLERANCE.get(dtype, 1e-2):
        return f"{what} disagrees with torch by {worst:.3g} (relative) in {dtype}"
    return None


def _attention(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> str | None:
    from replicas.model.kernels.paged_attention import (
        paged_decode_attention,
        paged_prefill_attention,
        write_kv,
    )

    generator = torch.Generator(device="cpu").manual_seed(7)
    block_size, blocks, lengths = 16, 8, [5, 37]
    rows = blocks * block_size

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    key_cache, value_cache = rand(rows, kv_heads, head_dim), rand(rows, kv_heads, head_dim)
    new_keys, new_values = rand(3, kv_heads, head_dim), rand(3, kv_heads, head_dim)
    slots = torch.tensor([17, -1, 100], dtype=torch.int64, device=device)
    write_kv(new_keys, new_values, key_cache, value_cache, slots)
    if not (
        torch.equal(key_cache[[17, 100]], new_keys[[0, 2]]) and torch.equal(value_cache[100], new_values[2])
    ):
        return f"the KV write kernel wrote the wrong rows on {device} ({dtype})"
    tables = torch.tensor([[5, 2, 7], [1, 6, 3]], dtype=torch.int32, device=device)
    context = torch.tensor(lengths, dtype=torch.int32, device=device)
    q = rand(len(lengths), heads, head_dim)
    got = paged_decode_attention(q, key_cache, value_cache, tables, context, block_size=block_size)
    want = torch.cat(
        [
            _reference(q[b : b + 1], key_cache, value_cache, tables[b], length, block_size)
            for b, length in enumerate(lengths)
        ]
    )
    problem = _close(got, want, "paged decode attention", dtype)
    if problem is not None:
        return problem
    cached, new = [3, 20], [4, 17]
    starts = torch.tensor([0, new[0], sum(new)], dtype=torch.int32, device=device)
    q = rand(sum(new), heads, head_dim)
    got = paged_prefill_attention(
        q,
        key_cache,
        value_cache,
        tables,
        starts,
        torch.tensor(cached, dtype=torch.int32, device=device),
        max_query_len=max(new),
        block_size=block_size,
    )
    pieces, offset = [], 0
    for b, (c, n) in enumerate(zip(cached, new)):
        pieces.append(
            _reference(q[offset : offset + n], key_cache, value_cache, tables[b], c + n, block_size)
        )
        offset += n
    return _close(got, torch.cat(pieces), "paged prefill attention", dtype)


def _reference(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    table: torch.Tensor,
    total: int,
    block_size: int,
) -> torch.Tensor:
    """Causal attention of `q` — the last `n` tokens of `[0, total)` — over that context, read through
    `table`, in float32: `[n, heads * d]`."""
    n, heads, head_dim = q.shape
    position = torch.arange(total, device=q.device)
    rows = table.long()[position // block_size] * block_size + position % block_size
    keys, values = key_cache[rows].float(), value_cache[rows].float()
    group = heads // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) / math.sqrt(head_dim)
    query_position = torch.arange(total - n, total, device=q.device)
    scores = scores.masked_fill(position[None, None, :] > query_position[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(n, heads * head_dim)


def _layer_ops(
    device: torch.device, dtype: torch.dtype, heads: int, head_dim: int, *, invariant: bool
) -> str | None:
    """RMSNorm and rotary (every kernel path), the matmul (batch-invariant models)."""
    from replicas.model.kernels.invariant import invariant_linear, invariant_rms_norm
    from replicas.model.kernels.rotary import rotary
    from replicas.model.layers import rms_norm
    from replicas.model.rope import apply_rotary

    generator = torch.Generator(device="cpu").manual_seed(11)
    x = torch.randn(5, 96, generator=generator).to(device=device, dtype=dtype)
    norm = torch.rand(96, generator=generator).to(device=device, dtype=dtype)
    got = invariant_rms_norm(x, norm, 1e-6)
    problem = _close(got, rms_norm(x.float(), norm.float(), 1e-6), "RMSNorm", dtype)
    if problem is not None:
        return problem
    angles = torch.rand(5, head_dim // 2, generator=generator) * 6.0
    cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
    q = torch.randn(5, heads, head_dim, generator=generator).to(device=device, dtype=dtype)
    problem = _close(rotary(q, cos, sin), apply_rotary(q.float(), cos.float(), sin.float()), "rotary", dtype)
    if problem is not None or not invariant:
        return problem
    weight = torch.randn(40, 96, generator=generator).to(device=device, dtype=dtype)
    bias = torch.randn(40, generator=generator).to(device=device, dtype=dtype)
    want = F.linear(x.float(), weight.float(), bias.float())
    return _close(invariant_linear(x, weight, bias), want, "matmul", dtype)
