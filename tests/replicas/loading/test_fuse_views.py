"""A peer copy's piece lands in one buffer; the layer is fused from views of it: q, k, v (and gate, up)
that lie back to back are the fused matrix as they lie, and a buffer whose large weights were packed
into storage of their own is not kept alive by the small tensors cut from it."""

from __future__ import annotations

import pytest
import torch

from replicas.model import TINY_CONFIG
from replicas.model.layers import LayerWeights, expected_layer_shapes, fuse_layer
from replicas.model.linear import Kernels


def _views(shapes: dict[str, tuple[int, ...]]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    total = sum(torch.Size(shape).numel() for shape in shapes.values())
    buffer = torch.randn(total, generator=torch.Generator().manual_seed(5))
    views, at = {}, 0
    for name, shape in shapes.items():
        size = torch.Size(shape).numel()
        views[name] = buffer[at : at + size].view(shape)
        at += size
    return buffer, views


def _owned(views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in views.items()}  # each in a storage of its own


def _dense(layer: LayerWeights) -> list[torch.Tensor]:
    return [
        layer.input_norm,
        layer.post_norm,
        *(
            p.weight.to_dense() if p.packed else p.weight
            for p in (layer.qkv, layer.o, layer.gate_up, layer.down)
        ),
    ]


@pytest.mark.parametrize("kernels", ["plain", "packed"])
def test_a_layer_fused_from_one_buffer_equals_one_fused_from_tensors_of_their_own(kernels: Kernels) -> None:
    config = TINY_CONFIG
    buffer, views = _views(expected_layer_shapes(config))
    fused = fuse_layer(views, torch.float32, torch.device("cpu"), kernels=kernels)
    reference = fuse_layer(_owned(views), torch.float32, torch.device("cpu"), kernels=kernels)
    for got, want in zip(_dense(fused), _dense(reference), strict=True):
        assert torch.equal(got, want)
    storage = buffer.untyped_storage().data_ptr()
    if kernels == "plain":  # no copy: the fused matrices are the buffer's rows
        assert fused.qkv.weight.untyped_storage().data_ptr() == storage
        assert fused.gate_up.weight.untyped_storage().data_ptr() == storage
        assert fused.input_norm.untyped_storage().data_ptr() == storage
    else:  # the large weights packed apart: the norms are cloned out, the buffer is not kept
        assert fused.qkv.packed and fused.gate_up.packed
        assert fused.input_norm.untyped_storage().data_ptr() != storage
        assert fused.post_norm.untyped_storage().data_ptr() != storage


def test_tensors_not_back_to_back_are_concatenated() -> None:
    config = TINY_CONFIG
    _, views = _views(expected_layer_shapes(config))
    views["self_attn.k_proj.weight"] = views["self_attn.k_proj.weight"].clone()
    fused = fuse_layer(views, torch.float32, torch.device("cpu"), kernels="plain")
    q, k, v = (views[f"self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(fused.qkv.weight, torch.cat([q, k, v]))
    assert fused.qkv.weight.untyped_storage().data_ptr() != q.untyped_storage().data_ptr()


def test_a_layer_installed_plain_and_packed_afterwards_equals_one_packed_at_once() -> None:
    """A copy installs layers plain and packs them once it is done: the same weights as packing at the
    load, the buffer no longer kept by the small tensors, and nothing left to pack a second time."""
    from replicas.model.layers import packed_layer

    buffer, views = _views(expected_layer_shapes(TINY_CONFIG))
    plain = fuse_layer(views, torch.float32, torch.device("cpu"), kernels="plain")
    assert packed_layer(plain, "plain") is None
    packed = packed_layer(plain, "packed")
    assert packed is not None
    reference = fuse_layer(_owned(views), torch.float32, torch.device("cpu"), kernels="packed")
    assert [p.packed for p in (packed.qkv, packed.o, packed.gate_up, packed.down)] == [
        p.packed for p in (reference.qkv, reference.o, reference.gate_up, reference.down)
    ]
    for got, want in zip(_dense(packed), _dense(reference), strict=True):
        assert torch.equal(got, want)
    if packed.qkv.packed:
        assert packed.input_norm.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
        assert packed_layer(packed, "packed") is None
