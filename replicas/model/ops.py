"""The per-row operations of a layer — RMSNorm, a projection, a projection added to the residual, rotary
embedding — as one swappable set: torch's, the kernel path's, or the batch-invariant ones.

`TORCH_OPS`: torch and the `Linear` kernels (oneDNN packing on CPU, cuBLAS on a GPU); RMSNorm and rotary
are several small torch ops each (the CPU path). `kernel_ops()`: the same projections, with RMSNorm and
rotary in one Triton launch each — a GPU decode step of a 22-layer model launches some 500 fewer kernels.
On a GPU a row's projection may still depend on the batch around it (cuBLAS picks split-K kernels by
shape). `invariant_ops()`: the projections and RMSNorm of `replicas.model.kernels.invariant`, whose
result for a row is bitwise the same whatever batch it is in (`--batch-invariant`, docs/gpu.md); they need
plain (unpacked) weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import final

import torch

from replicas.model.layers import rms_norm
from replicas.model.linear import Linear
from replicas.model.rope import apply_rotary


@final
@dataclass(frozen=True, slots=True)
class LayerOps:
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    linear: Callable[[Linear, torch.Tensor], torch.Tensor]
    # (projection, residual, x) -> residual + projection(x), in place in the residual where it can
    add_linear: Callable[[Linear, torch.Tensor, torch.Tensor], torch.Tensor]
    # (x [N, heads, d], cos, sin) -> a new contiguous tensor, as `replicas.model.rope.apply_rotary`
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


TORCH_OPS = LayerOps(
    rms_norm=rms_norm,
    linear=lambda projection, x: projection(x),
    add_linear=lambda projection, residual, x: projection.add_to(residual, x),
    rotary=apply_rotary,
)


def kernel_ops() -> LayerOps:
    """The kernel path's set (imports Triton)."""
    from replicas.model.kernels.invariant import invariant_rms_norm
    from replicas.model.kernels.rotary import rotary

    return LayerOps(
        rms_norm=invariant_rms_norm,
        linear=TORCH_OPS.linear,
        add_linear=TORCH_OPS.add_linear,
        rotary=rotary,
    )


def invariant_ops() -> LayerOps:
    """The batch-invariant set (imports Triton)."""
    from replicas.model.kernels.invariant import invariant_linear, invariant_rms_norm
    from replicas.model.kernels.rotary import rotary

    def linear(projection: Linear, x: torch.Tensor) -> torch.Tensor:
        assert not projection.packed, "batch-invariant kernels need plain weights (kernels='plain')"
        return invariant_linear(x, projection.weight, projection.bias)

    def add_linear(projection: Linear, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        assert not projection.packed, "batch-invariant kernels need plain weights (kernels='plain')"
        return invariant_linear(x, projection.weight, projection.bias, residual=residual)

    return LayerOps(rms_norm=invariant_rms_norm, linear=linear, add_linear=add_linear, rotary=rotary)
