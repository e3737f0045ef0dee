"""`Linear`: the packed (oneDNN) and plain paths compute the same projection, below and above the
row count where the packed weight is turned back into a plain one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from replicas.model.linear import DENSE_FROM_ROWS, PACK_MIN_ELEMENTS, Linear


@pytest.mark.parametrize("rows", [1, 5, DENSE_FROM_ROWS + 3])
@pytest.mark.parametrize("with_bias", [True, False])
def test_packed_and_plain_agree_with_f_linear(rows: int, with_bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=generator)
    bias = torch.randn(96, generator=generator) if with_bias else None
    x = torch.randn(rows, 64, generator=generator)
    residual = torch.randn(rows, 96, generator=generator)
    expected = F.linear(x, weight, bias)
    for kernels in ("packed", "plain"):
        projection = Linear(weight.clone(), bias, kernels=kernels)
        assert projection.packed == (kernels == "packed" and torch.backends.mkldnn.is_available())
        torch.testing.assert_close(projection(x), expected, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(
            projection.add_to(residual.clone(), x), residual + expected, rtol=1e-5, atol=1e-4
        )
        assert projection.nbytes == weight.numel() * 4 + (96 * 4 if with_bias else 0)


def test_auto_packs_only_large_float32_cpu_weights() -> None:
    small = Linear(torch.randn(64, 64), None)
    assert not small.packed
    assert not Linear(torch.randn(PACK_MIN_ELEMENTS // 64, 64, dtype=torch.float16), None).packed
    assert not Linear(torch.randn(PACK_MIN_ELEMENTS // 64, 64), None, kernels="plain").packed
    large = Linear(torch.randn(PACK_MIN_ELEMENTS // 64, 64), None)
    assert large.packed == torch.backends.mkldnn.is_available()


@pytest.mark.parametrize("kernels", ["packed", "plain"])
def test_a_clone_keeps_the_layout_and_owns_its_memory(kernels: str) -> None:
    """A host copy of a CPU model is a clone of its fused (and packed) weights: same results, same
    layout, none of the original's memory."""
    weight, bias = torch.randn(64, 32), torch.randn(64)
    original = Linear(weight, bias, kernels=kernels)  # type: ignore[arg-type]
    copy = original.clone()
    x = torch.randn(5, 32)
    assert copy.packed == original.packed == (kernels == "packed" and original.packed)
    assert torch.equal(copy(x), original(x))
    assert copy.weight is not original.weight and copy.bias is not original.bias
    assert copy.bias is not None and copy.bias.data_ptr() != bias.data_ptr()
    if not copy.packed:
        assert copy.weight.data_ptr() != original.weight.data_ptr()
    residual = torch.randn(5, 64)
    assert torch.equal(copy.add_to(residual.clone(), x), original.add_to(residual.clone(), x))
