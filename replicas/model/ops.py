"""The per-row operations of a layer — RMSNorm, a projection, a projection added to the residual — as
one swappable set, so a model can run torch's kernels (the default) or the batch-invariant ones.

`TORCH_OPS`: torch and the `Linear` kernels (oneDNN packing on CPU, cuBLAS on a GPU) — fastest, but on a
GPU a row's result may depend on the batch around it (cuBLAS picks split-K kernels by shape, torch's
reductions pick their strategy by shape). `invariant_ops()`: the Triton kernels of
`replicas.model.kernels.invariant`, whose result for a row is bitwise the same whatever batch it is in
(`--batch-invariant`, docs/gpu.md); they need plain (unpacked) weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import final

import torch

from replicas.model.layers import rms_norm
from replicas.model.linear import Linear


@final
@dataclass(frozen=True, slots=True)
class LayerOps:
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    linear: Callable[[Linear, torch.Tensor], torch.Tensor]
    # (projection, residual, x) -> residual + projection(x), in place in the residual where it can
    add_linear: Callable[[Linear, torch.Tensor, torch.Tensor], torch.Tensor]


TORCH_OPS = LayerOps(
    rms_norm=rms_norm,
    linear=lambda projection, x: projection(x),
    add_linear=lambda projection, residual, x: projection.add_to(residual, x),
)


def invariant_ops() -> LayerOps:
    """The batch-invariant set (imports Triton)."""
    from replicas.model.kernels.invariant import invariant_linear, invariant_rms_norm

    def linear(projection: Linear, x: torch.Tensor) -> torch.Tensor:
        assert not projection.packed, "batch-invariant kernels need plain weights (kernels='plain')"
        return invariant_linear(x, projection.weight, projection.bias)

    def add_linear(projection: Linear, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        assert not projection.packed, "batch-invariant kernels need plain weights (kernels='plain')"
        return invariant_linear(x, projection.weight, projection.bias, residual=residual)

    return LayerOps(rms_norm=invariant_rms_norm, linear=linear, add_linear=add_linear)
