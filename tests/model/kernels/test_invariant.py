"""The batch-invariant matmul and RMSNorm (`replicas/model/kernels/invariant.py`): close to torch, and row i
of each result bitwise the same whether it is computed alone or among other rows. Without CUDA the kernels
run in Triton's interpreter on CPU tensors (`tests/conftest.py`), so the shapes are small."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from replicas.model.kernels.invariant import invariant_linear, invariant_rms_norm
from replicas.model.layers import rms_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
# (K, N): tile multiples, and neither K nor N a multiple of the tiles.
SHAPES = [(64, 128), (130, 70)]


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=DEVICE)


def _assert_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    # float32: the same float32 arithmetic as the reference up to the summation order. bfloat16: the
    # reference is computed in float32 from the same inputs; the kernel rounds its result to bfloat16 once
    # (to nearest on a GPU: at most 2**-8 relative; Triton 3.9's interpreter truncates: at most 2**-7).
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_torch(dtype: torch.dtype, k: int, n: int, with_bias: bool) -> None:
    m = 37
    x = _randn(m, k, dtype=dtype, seed=1)
    weight = _randn(n, k, dtype=dtype, seed=2, scale=k**-0.5)
    bias = _randn(n, dtype=dtype, seed=3) if with_bias else None
    got = invariant_linear(x, weight, bias)
    assert got.dtype == dtype and got.shape == (m, n)
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    _assert_close(got, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_adds_into_residual_in_place(dtype: torch.dtype, with_bias: bool) -> None:
    m, k, n = 5, 130, 70
    x = _randn(m, k, dtype=dtype, seed=4)
    weight = _randn(n, k, dtype=dtype, seed=5, scale=k**-0.5)
    bias = _randn(n, dtype=dtype, seed=6) if with_bias else None
    residual = _randn(m, n, dtype=dtype, seed=7)
    expected = residual.float() + F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    got = invariant_linear(x, weight, bias, residual=residual)
    assert got is residual
    _assert_close(got, expected, dtype)


def test_linear_reads_the_weight_by_strides() -> None:
    """A transposed view as the weight, and rows of x taken with a stride: no copies are needed."""
    m, k, n = 6, 40, 24
    x_wide = _randn(m, 2 * k, dtype=torch.float32, seed=8)
    x = x_wide[:, ::2]
    weight = _randn(k, n, dtype=torch.float32, seed=9).t()  # [n, k] with strides (1, n)
    got = invariant_linear(x, weight)
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_linear_rejects_mismatched_shapes_and_dtypes() -> None:
    x = _randn(2, 8, dtype=torch.float32, seed=10)
    with pytest.raises(ValueError, match="features"):
        invariant_linear(x, _randn(4, 9, dtype=torch.float32, seed=11))
    with pytest.raises(ValueError, match="dtype"):
        invariant_linear(x, _randn(4, 8, dtype=torch.bfloat16, seed=11))
    with pytest.raises(ValueError, match="residual"):
        invariant_linear(
            x, _randn(4, 8, dtype=torch.float32, seed=11), residual=_randn(3, 4, dtype=torch.float32, seed=12)
        )


def test_linear_with_no_rows_returns_an_empty_result() -> None:
    weight = _randn(16, 8, dtype=torch.float32, seed=13)
    got = invariant_linear(torch.empty(0, 8, device=DEVICE), weight)
    assert got.shape == (0, 16)


def _rows_around(row: torch.Tensor, m: int, at: int, seed: int) -> torch.Tensor:
    """`m` random rows with `row` at index `at`."""
    batch = _randn(m, row.shape[-1], dtype=row.dtype, seed=seed)
    batch[at] = row
    return batch


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_linear_row_is_batch_invariant(dtype: torch.dtype, k: int, n: int, with_residual: bool) -> None:
    """Row i alone (M=1), inside M=3, M=37 and M=70 (in the second row tile) with other random rows."""
    weight = _randn(n, k, dtype=dtype, seed=20, scale=k**-0.5)
    bias = _randn(n, dtype=dtype, seed=21)
    row = _randn(1, k, dtype=dtype, seed=22)
    res_row = _randn(1, n, dtype=dtype, seed=23)
    alone = invariant_linear(row, weight, bias, residual=res_row.clone() if with_residual else None)
    for m, at, seed in [(3, 1, 24), (37, 0, 25), (37, 36, 26), (70, 65, 27)]:
        x = _rows_around(row[0], m, at, seed)
        residual = _rows_around(res_row[0], m, at, seed + 100) if with_residual else None
        batched = invariant_linear(x, weight, bias, residual=residual)
        assert torch.equal(batched[at], alone[0]), (m, at)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [64, 130])
def test_rms_norm_matches_layers_rms_norm(dtype: torch.dtype, h: int) -> None:
    x = _randn(9, h, dtype=dtype, seed=30, scale=3.0)
    weight = (1.0 + _randn(h, dtype=torch.float32, seed=31, scale=0.1)).to(dtype)
    got = invariant_rms_norm(x, weight, 1e-6)
    expected = rms_norm(x, weight, 1e-6)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:  # two bfloat16 roundings (before and after the weight), truncations in Triton 3.9's interpreter
        torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=1e-2)


def test_rms_norm_loops_over_chunks_when_the_row_is_wide(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunked loop (hidden size over `RMS_MAX_BLOCK`), with a small block to keep the interpreter fast."""
    from replicas.model.kernels import invariant

    monkeypatch.setattr(invariant, "RMS_MAX_BLOCK", 32)
    x = _randn(4, 100, dtype=torch.float32, seed=32)
    weight = _randn(100, dtype=torch.float32, seed=33)
    torch.testing.assert_close(
        invariant_rms_norm(x, weight, 1e-5), rms_norm(x, weight, 1e-5), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [64, 130])
def test_rms_norm_row_is_batch_invariant(dtype: torch.dtype, h: int) -> None:
    weight = (1.0 + _randn(h, dtype=torch.float32, seed=40, scale=0.1)).to(dtype)
    row = _randn(1, h, dtype=dtype, seed=41, scale=2.0)
    alone = invariant_rms_norm(row, weight, 1e-6)
    for m, at, seed in [(3, 1, 42), (37, 0, 43), (37, 36, 44)]:
        batched = invariant_rms_norm(_rows_around(row[0], m, at, seed), weight, 1e-6)
        assert torch.equal(batched[at], alone[0]), (m, at)
