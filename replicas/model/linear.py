"""Projections `y = x @ W.T + b` with the fastest kernel available for the weight's device and dtype.

On CPU, when PyTorch has oneDNN, a weight is reordered once at load into oneDNN's blocked layout and
multiplied with oneDNN's linear primitive (what PyTorch's own compiler does for frozen CPU models). For
the skinny products of decode (a few rows) this is up to two to three times faster than the default
BLAS path on CPUs where that path is weak (measured on AMD EPYC); from `DENSE_FROM_ROWS` rows on
(prefill) the BLAS path runs. Where oneDNN is unavailable — CUDA, a dtype the CPU cannot run in oneDNN,
a PyTorch without the ops — or the weight is small (a oneDNN call has a fixed cost of some 40-50 µs),
the weight stays a plain tensor and `torch.nn.functional.linear` runs. The choice is made per weight at
load, with a self-check against `F.linear` on a small input; the result is read-only and thread-safe.
"""

from __future__ import annotations

from typing import Literal, final

import structlog
import torch
import torch.nn.functional as F

_log = structlog.get_logger("replicas.model.linear")
_refusals_said: set[str] = set()  # each distinct refusal is logged once, not once per layer
# Weight shapes (with dtype, and whether a bias comes) whose packing this process checked once against
# `F.linear`: the probe reads the weight twice more, as much as the reorder itself, so a model's later
# layers of the same shapes pack without it (the outcome depends on the build, CPU and shape, not values).
_packing_checked: set[tuple[tuple[int, ...], torch.dtype, bool]] = set()

# "auto": oneDNN for large CPU float32 weights; "packed": oneDNN wherever it runs (tests, experiments);
# "plain": `F.linear` everywhere.
Kernels = Literal["auto", "packed", "plain"]

# The reorder is tuned for a typical decode batch; any batch size works with the reordered weight.
PACKING_BATCH_HINT = 16
# A oneDNN call costs some 40-50 µs more than a BLAS call; it pays off only for weights at least this large.
PACK_MIN_ELEMENTS = 1 << 19
# From this many rows on (prefill) the BLAS path is as fast or faster; the weight is turned back into a
# plain tensor for the call (a copy of the weight, about 1 % of such a product's time).
DENSE_FROM_ROWS = 512


def _onednn_ops_present() -> bool:
    mkldnn = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_linear_pointwise")
        and hasattr(mkldnn, "_reorder_linear_weight")
    )


@final
class Linear:
    """One projection. `packed` tells whether the oneDNN path is used (then `weight` is the reordered tensor)."""

    __slots__ = ("bias", "in_features", "out_features", "packed", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, kernels: Kernels = "auto") -> None:
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.bias = bias
        self.weight = weight
        self.packed = False
        large_enough = kernels == "packed" or weight.numel() >= PACK_MIN_ELEMENTS
        if (
            kernels != "plain"
            and large_enough
            and weight.device.type == "cpu"
            and weight.dtype == torch.float32
            and _onednn_ops_present()
        ):
            self._try_packing(weight)

    def _try_packing(self, weight: torch.Tensor) -> None:
        key = (tuple(weight.shape), weight.dtype, self.bias is not None)
        if key in _packing_checked:  # this build and CPU packed a weight of this shape right before
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_BATCH_HINT)
            self.packed = True
            return
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_BATCH_HINT)
            probe = torch.linspace(-1.0, 1.0, 3 * self.in_features, dtype=weight.dtype).view(
                3, self.in_features
            )
            got = torch.ops.mkldnn._linear_pointwise(probe, packed, self.bias, "none", [], "")
        except RuntimeError as exc:  # this build or CPU cannot pack: the plain linear serves
            if str(exc) not in _refusals_said:
                _refusals_said.add(str(exc))
                _log.info("model.linear_packing_unavailable", error=str(exc), fallback="F.linear")
            return
        expected = F.linear(probe, weight, self.bias)
        if got.shape == expected.shape and torch.allclose(got, expected, rtol=1e-4, atol=1e-4):
            self.weight = packed
            self.packed = True
            _packing_checked.add(key)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `[rows, in_features]` → `[rows, out_features]`."""
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        if x.shape[0] < DENSE_FROM_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight.to_dense(), self.bias)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`residual + self(x)`; the BLAS path accumulates into `residual` in place (no temporary)."""
        weight = self.weight
        if self.packed:
            if x.shape[0] < DENSE_FROM_ROWS:
                return torch.ops.mkldnn._linear_pointwise.binary(x, residual, weight, self.bias, "add")
            weight = weight.to_dense()
        residual.addmm_(x, weight.t())
        if self.bias is not None:
            residual.add_(self.bias)
        return residual

    def clone(self) -> Linear:
        """A copy in memory of its own, in the same layout (a packed weight stays packed: copying the
        reordered tensor is as fast as copying any other, reordering again is not)."""
        copy = Linear.__new__(Linear)
        copy.out_features, copy.in_features = self.out_features, self.in_features
        copy.weight, copy.packed = self.weight.clone(), self.packed
        copy.bias = None if self.bias is None else self.bias.clone()
        return copy

    @property
    def nbytes(self) -> int:
        total = self.out_features * self.in_features * self.weight.element_size()
        return total + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())
