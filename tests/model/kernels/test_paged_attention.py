"""The paged-attention and KV-write kernels against a float64 torch reference, and their batch invariance.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (`tests/conftest.py`), so shapes stay
small. Caches are filled with NaN except the rows the sequences own, and block tables come from a random
permutation of the blocks: a kernel that reads a row it should not, or mixes up blocks, shows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from replicas.model.kernels.paged_attention import (
    PREFILL_BLOCK_M,
    paged_decode_attention,
    paged_prefill_attention,
    write_kv,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F32, BF16 = torch.float32, torch.bfloat16
TOLERANCE = {F32: 1e-5, BF16: 2e-2}


@dataclass(frozen=True)
class Paged:
    key_cache: torch.Tensor  # [rows, kv_heads, d]
    value_cache: torch.Tensor
    tables: torch.Tensor  # int32 [B, max_blocks]; entries past a sequence's blocks are 0
    block_size: int


def paged_cache(
    lengths: list[int], *, kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int, seed: int = 0
) -> Paged:
    """Sequence b owns `cdiv(lengths[b], block_size)` blocks, taken from a random permutation, its rows
    `[0, lengths[b])` random; every other row (spare blocks, the tails of last blocks) is NaN."""
    generator = torch.Generator().manual_seed(seed)
    owned = [-(-length // block_size) for length in lengths]
    num_blocks = sum(owned) + 3
    order = torch.randperm(num_blocks, generator=generator).tolist()
    shape = (num_blocks * block_size, kv_heads, head_dim)
    key_cache = torch.full(shape, math.nan, dtype=dtype)
    value_cache = torch.full(shape, math.nan, dtype=dtype)
    tables = torch.zeros((len(lengths), max(owned, default=0) + 1), dtype=torch.int32)
    for b, (length, count) in enumerate(zip(lengths, owned)):
        ids, order = order[:count], order[count:]
        tables[b, :count] = torch.tensor(ids, dtype=torch.int32)
        rows = context_rows(tables[b], length, block_size)
        key_cache[rows] = torch.randn(length, kv_heads, head_dim, generator=generator).to(dtype)
        value_cache[rows] = torch.randn(length, kv_heads, head_dim, generator=generator).to(dtype)
    return Paged(key_cache.to(DEVICE), value_cache.to(DEVICE), tables.to(DEVICE), block_size)


def context_rows(table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    position = torch.arange(length, device=table.device)
    return table.long()[position // block_size] * block_size + position % block_size


def reference(q: torch.Tensor, paged: Paged, b: int, cached: int) -> torch.Tensor:
    """Float64 causal attention of `q` `[n, heads, d]` — the tokens at positions `[cached, cached + n)` of
    sequence `b` — over positions `[0, cached + n)` gathered through its block table: `[n, heads * d]`."""
    n, heads, head_dim = q.shape
    total = cached + n
    rows = context_rows(paged.tables[b], total, paged.block_size)
    keys, values = paged.key_cache[rows].double(), paged.value_cache[rows].double()
    group = heads // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) / math.sqrt(head_dim)
    visible = (
        torch.arange(total, device=q.device)[None, :] <= torch.arange(cached, total, device=q.device)[:, None]
    )
    scores = scores.masked_fill(~visible, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(n, heads * head_dim)


def random(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=DEVICE)


def int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype
    assert not got.isnan().any()
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), want, atol=tolerance, rtol=tolerance)


# ---------------------------------------------------------------------------------------------- write_kv
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kv_writes_its_rows_and_skips_negative_slots(
    dtype: torch.dtype, slot_dtype: torch.dtype
) -> None:
    kv_heads, head_dim, rows = 2, 80, 48
    key_cache, value_cache = (
        random(rows, kv_heads, head_dim, dtype=dtype, seed=1),
        random(rows, kv_heads, head_dim, dtype=dtype, seed=2),
    )
    before_keys, before_values = key_cache.clone(), value_cache.clone()
    # key/value as slices of a fused projection: strided rows, contiguous last dimension
    fused = random(5, 3 * kv_heads, head_dim, dtype=dtype, seed=3)
    key, value = fused[:, kv_heads : 2 * kv_heads], fused[:, 2 * kv_heads :]
    slots = torch.tensor([17, -1, 0, 47, -5], dtype=slot_dtype, device=DEVICE)
    write_kv(key, value, key_cache, value_cache, slots)
    written = [(0, 17), (2, 0), (3, 47)]
    for i, slot in written:
        assert torch.equal(key_cache[slot], key[i]) and torch.equal(value_cache[slot], value[i])
    untouched = [r for r in range(rows) if r not in {slot for _, slot in written}]
    assert torch.equal(key_cache[untouched], before_keys[untouched])
    assert torch.equal(value_cache[untouched], before_values[untouched])


def test_write_kv_of_no_tokens_and_of_mismatched_shapes() -> None:
    cache = random(16, 2, 32, dtype=F32, seed=0)
    empty = cache[:0]
    write_kv(empty, empty, cache, cache.clone(), torch.zeros(0, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="do not fit"):
        write_kv(cache[:2, :1], cache[:2, :1], cache, cache.clone(), int32([0, 1]))
    with pytest.raises(ValueError, match="slots"):
        write_kv(cache[:2], cache[:2], cache, cache.clone(), int32([0, 1, 2]))


# ------------------------------------------------------------------------------------------------ decode
DECODE_CASES = [
    # heads, kv_heads, head_dim, block_size, dtype, context lengths
    (8, 2, 64, 16, F32, [37, 1, 100, 16]),
    (4, 4, 32, 8, F32, [9, 64, 23]),
    (8, 2, 80, 16, F32, [50, 17]),
    (32, 1, 32, 16, F32, [20, 45]),  # a group of 32 query heads: more than one dot tile of rows
    (4, 2, 8, 16, F32, [20, 3]),  # head_dim below tl.dot's 16: padded
    (8, 2, 64, 16, BF16, [37, 1, 100, 16]),
    (4, 4, 32, 32, BF16, [33, 64, 5]),
]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size", "dtype", "lengths"), DECODE_CASES)
def test_decode_matches_the_reference(
    heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, lengths: list[int]
) -> None:
    paged = paged_cache(lengths, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, block_size=block_size)
    q = random(len(lengths), heads, head_dim, dtype=dtype, seed=5)
    got = paged_decode_attention(
        q, paged.key_cache, paged.value_cache, paged.tables, int32(lengths), block_size=block_size
    )
    assert got.shape == (len(lengths), heads * head_dim)
    for b, length in enumerate(lengths):
        assert_close(got[b : b + 1], reference(q[b : b + 1], paged, b, length - 1), dtype)


def test_decode_gives_zeros_for_a_padded_row_and_writes_into_out() -> None:
    lengths = [30, 0, 7]
    paged = paged_cache(lengths, kv_heads=2, head_dim=32, dtype=F32, block_size=16)
    q = random(3, 4, 32, dtype=F32, seed=6)
    out = torch.full((3, 4 * 32), math.nan, device=DEVICE)
    got = paged_decode_attention(
        q, paged.key_cache, paged.value_cache, paged.tables, int32(lengths), block_size=16, out=out, scale=0.3
    )
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(out[1], torch.zeros(4 * 32, device=DEVICE))
    unscaled = paged_decode_attention(
        q * 0.3 * math.sqrt(32),
        paged.key_cache,
        paged.value_cache,
        paged.tables,
        int32(lengths),
        block_size=16,
    )
    torch.testing.assert_close(out, unscaled, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_decode_is_batch_invariant(dtype: torch.dtype) -> None:
    """Sequence 0's output is bitwise the same alone, in a batch, elsewhere in the batch, beside padding."""
    lengths = [75, 3, 40, 100]
    paged = paged_cache(lengths, kv_heads=2, head_dim=64, dtype=dtype, block_size=16)
    q = random(len(lengths), 8, 64, dtype=dtype, seed=7)

    def decode(rows: list[int], context: list[int]) -> torch.Tensor:
        return paged_decode_attention(
            q[rows], paged.key_cache, paged.value_cache, paged.tables[rows], int32(context), block_size=16
        )

    alone = decode([0], [75])
    assert torch.equal(decode([0, 1, 2, 3], lengths)[0], alone[0])
    assert torch.equal(decode([3, 2, 0], [100, 40, 75])[2], alone[0])
    assert torch.equal(decode([1, 0, 2, 2, 2], [3, 75, 0, 0, 0])[1], alone[0])


# ----------------------------------------------------------------------------------------------- prefill
PREFILL_CASES = [
    # heads, kv_heads, head_dim, block_size, dtype, (cached, new) per sequence
    (8, 2, 64, 16, F32, [(0, 37), (0, 1), (0, 32), (0, 70)]),  # empty caches; 70 spans two query tiles
    (8, 2, 64, 16, F32, [(16, 5), (23, 40), (0, 9), (50, 1)]),
    (4, 4, 32, 8, F32, [(0, 16), (7, 9), (40, 30)]),
    (8, 2, 80, 32, F32, [(3, 20), (0, 33)]),
    (4, 2, 32, 16, F32, [(10, 1), (0, 1), (47, 1)]),  # single-token queries
    (2, 1, 8, 8, F32, [(0, 24), (5, 6)]),  # head_dim below tl.dot's 16: padded
    (8, 2, 64, 16, BF16, [(0, 37), (20, 30), (64, 1)]),
    (4, 4, 32, 32, BF16, [(0, 64), (31, 2)]),
]


def run_prefill(q: torch.Tensor, paged: Paged, spans: list[tuple[int, int]], rows: list[int]) -> torch.Tensor:
    """Prefill the sequences `rows` of `paged` (their `spans`), their new tokens packed from `q`."""
    starts = [0]
    for _, new in spans:
        starts.append(starts[-1] + new)
    return paged_prefill_attention(
        q,
        paged.key_cache,
        paged.value_cache,
        paged.tables[rows],
        int32(starts),
        int32([cached for cached, _ in spans]),
        max_query_len=max(new for _, new in spans),
        block_size=paged.block_size,
    )


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size", "dtype", "spans"), PREFILL_CASES)
def test_prefill_matches_the_reference(
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    spans: list[tuple[int, int]],
) -> None:
    lengths = [cached + new for cached, new in spans]
    paged = paged_cache(lengths, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, block_size=block_size)
    q = random(sum(new for _, new in spans), heads, head_dim, dtype=dtype, seed=8)
    got = run_prefill(q, paged, spans, list(range(len(spans))))
    assert got.shape == (q.shape[0], heads * head_dim)
    start = 0
    for b, (cached, new) in enumerate(spans):
        assert_close(got[start : start + new], reference(q[start : start + new], paged, b, cached), dtype)
        start += new


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_prefill_is_batch_invariant(dtype: torch.dtype) -> None:
    """Sequence 0's output is bitwise the same alone and packed after others with longer queries."""
    spans = [(5, 30), (0, PREFILL_BLOCK_M + 10), (12, 3)]
    paged = paged_cache([c + n for c, n in spans], kv_heads=2, head_dim=32, dtype=dtype, block_size=16)
    q = random(30, 4, 32, dtype=dtype, seed=9)
    others = random(PREFILL_BLOCK_M + 13, 4, 32, dtype=dtype, seed=10)
    alone = run_prefill(q, paged, spans[:1], [0])
    packed = run_prefill(
        torch.cat([others[:3], q, others[3:]]), paged, [spans[2], spans[0], spans[1]], [2, 0, 1]
    )
    assert torch.equal(packed[3:33], alone)


def test_prefill_after_write_kv_agrees_with_decode_of_the_last_token() -> None:
    """The executor's path: cached prefixes, the new tokens written by `write_kv` (a padded slot among
    them), then prefill; the last new token's output is what decode computes for it (the two kernels tile
    differently: close, not equal)."""
    spans = [(20, 13), (0, 16)]
    paged = paged_cache([c + n for c, n in spans], kv_heads=2, head_dim=64, dtype=F32, block_size=16)
    slots = torch.cat([context_rows(paged.tables[0], 33, 16)[20:], context_rows(paged.tables[1], 16, 16)])
    paged.key_cache[slots] = math.nan
    paged.value_cache[slots] = math.nan
    n = slots.shape[0]
    keys, values = random(n + 1, 2, 64, dtype=F32, seed=11), random(n + 1, 2, 64, dtype=F32, seed=12)
    padded = torch.cat([slots[:5], torch.tensor([-1], device=DEVICE), slots[5:]])
    write_kv(keys, values, paged.key_cache, paged.value_cache, padded)
    assert not paged.key_cache[slots].isnan().any() and not paged.value_cache[slots].isnan().any()
    q = random(n, 8, 64, dtype=F32, seed=13)
    got = run_prefill(q, paged, spans, [0, 1])
    assert_close(got[:13], reference(q[:13], paged, 0, 20), F32)
    assert_close(got[13:], reference(q[13:], paged, 1, 0), F32)
    last = paged_decode_attention(
        q[[12, n - 1]], paged.key_cache, paged.value_cache, paged.tables, int32([33, 16]), block_size=16
    )
    torch.testing.assert_close(last, got[[12, n - 1]], atol=1e-5, rtol=1e-5)


def test_attention_refuses_shapes_it_cannot_serve() -> None:
    paged = paged_cache([10], kv_heads=4, head_dim=32, dtype=F32, block_size=16)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(
            random(1, 6, 32, dtype=F32, seed=0),
            paged.key_cache,
            paged.value_cache,
            paged.tables,
            int32([10]),
            block_size=16,
        )
    with pytest.raises(ValueError, match="does not fit"):
        paged_prefill_attention(
            random(10, 4, 32, dtype=BF16, seed=0),
            paged.key_cache,
            paged.value_cache,
            paged.tables,
            int32([0, 10]),
            int32([0]),
            max_query_len=10,
            block_size=16,
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: CUDA graphs")
def test_write_kv_and_decode_replay_from_a_cuda_graph() -> None:
    """Captured once, replayed on new values in the same buffers: bitwise what an eager call gives."""
    lengths = [40, 7, 90]
    paged = paged_cache(lengths, kv_heads=2, head_dim=64, dtype=BF16, block_size=16)
    q, keys, values = (random(3, h, 64, dtype=BF16, seed=s) for h, s in ((8, 20), (2, 21), (2, 22)))
    slots = torch.tensor([0, -1, 1], dtype=torch.int64, device=DEVICE)
    context = int32(lengths)

    def step() -> torch.Tensor:
        write_kv(keys, values, paged.key_cache, paged.value_cache, slots)
        return paged_decode_attention(
            q, paged.key_cache, paged.value_cache, paged.tables, context, block_size=16
        )

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    q.copy_(random(3, 8, 64, dtype=BF16, seed=23))
    context.copy_(int32([41, 0, 89]))
    new_row = int(context_rows(paged.tables[0], 41, 16)[40])  # sequence 0's token 40, in its third block
    slots.copy_(torch.tensor([new_row, -1, -1], device=DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, step())
    assert torch.equal(captured[1], torch.zeros_like(captured[1]))
