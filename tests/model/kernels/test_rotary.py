"""The one-launch rotary kernel against `apply_rotary` (torch), on views of a fused projection."""

from __future__ import annotations

import pytest
import torch

from replicas.model.kernels.rotary import rotary
from replicas.model.rope import apply_rotary

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(("heads", "dim"), [(4, 32), (3, 80), (2, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_apply_rotary_on_a_strided_view(heads: int, dim: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(heads * dim)
    n = 7
    fused = torch.randn(n, heads * dim + 24, generator=generator).to(device=DEVICE, dtype=dtype)
    x = fused[:, : heads * dim].view(n, heads, dim)  # rows strided like the q part of qkv
    angles = torch.rand(n, dim // 2, generator=generator) * 6.0
    cos, sin = angles.cos().to(DEVICE, dtype), angles.sin().to(DEVICE, dtype)
    got = rotary(x, cos, sin)
    want = apply_rotary(x, cos, sin)
    assert got.is_contiguous() and got.shape == want.shape and got.dtype == dtype
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)


def test_rotary_refuses_what_does_not_fit() -> None:
    x = torch.zeros(2, 3, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"^rotary: cos and sin must be \[2, 4\] in torch.float32"):
        rotary(x, torch.zeros(2, 3, device=DEVICE), torch.zeros(2, 3, device=DEVICE))
    with pytest.raises(ValueError, match=r"^rotary: x must be \[N, heads, d\] with an even, contiguous d"):
        rotary(torch.zeros(2, 3, 7, device=DEVICE), torch.zeros(2, 3), torch.zeros(2, 3))
