"""A loaded model's piece as the checkpoint's tensors: the inverse of the loader's fusing.

A `Model` keeps q/k/v and gate/up fused (`replicas.model.layers.fuse_layer`) and, on CPU, large float32
projections reordered into oneDNN's blocked layout (`replicas.model.linear`). A peer sends the checkpoint's
own tensors instead, so any receiver — whatever its kernels or device — converts and fuses them as its
own loader would: fused weights are split back by rows, packed ones turned back to dense
(`Tensor.to_dense`, an exact reordering). The tensors come out contiguous, in the model's dtype, on its
device; unpacked ones are views of the model's own (read-only) weights. Synchronous (packed weights cost
a copy: the sender runs it in a worker thread); nothing to cancel.
"""

from __future__ import annotations

import torch

from messages.weights import WeightPiece
from replicas.loading.pieces import layer_prefix, piece_shapes
from replicas.model.config import ModelConfig
from replicas.model.layers import LayerWeights
from replicas.model.linear import Linear
from replicas.model.llama import Model


def dense_weight(linear: Linear) -> torch.Tensor:
    """The projection's weight as a plain `[out, in]` tensor (a fresh one when it was packed)."""
    return linear.weight.to_dense() if linear.packed else linear.weight


def _split(tensor: torch.Tensor, sizes: list[int], names: list[str]) -> dict[str, torch.Tensor]:
    return {name: part.contiguous() for name, part in zip(names, tensor.split(sizes, dim=0), strict=True)}


def layer_tensors(model: Model, index: int) -> dict[str, torch.Tensor]:
    """Layer `index`'s tensors under their full HF names (`model.layers.{index}.…`)."""
    layer: LayerWeights | None = model.layers[index]
    if layer is None:
        raise ValueError(f"layer {index} of {model.name!r} is not loaded")
    return fused_layer_tensors(layer, model.config, index)


def fused_layer_tensors(layer: LayerWeights, config: ModelConfig, index: int) -> dict[str, torch.Tensor]:
    """Layer `index`'s tensors, split back out of `layer` (fused and maybe packed by `config`'s loader),
    under their full HF names."""
    attn, mlp = "self_attn.", "mlp."
    qkv_sizes = [config.q_size, config.kv_size, config.kv_size]
    qkv = [f"{attn}{p}_proj" for p in ("q", "k", "v")]
    gate_up = [f"{mlp}{p}_proj" for p in ("gate", "up")]
    inter = [config.intermediate_size, config.intermediate_size]
    tensors: dict[str, torch.Tensor] = {"input_layernorm.weight": layer.input_norm}
    tensors.update(_split(dense_weight(layer.qkv), qkv_sizes, [f"{n}.weight" for n in qkv]))
    if layer.qkv.bias is not None:
        tensors.update(_split(layer.qkv.bias, qkv_sizes, [f"{n}.bias" for n in qkv]))
    tensors[f"{attn}o_proj.weight"] = dense_weight(layer.o)
    if layer.o.bias is not None:
        tensors[f"{attn}o_proj.bias"] = layer.o.bias
    tensors["post_attention_layernorm.weight"] = layer.post_norm
    tensors.update(_split(dense_weight(layer.gate_up), inter, [f"{n}.weight" for n in gate_up]))
    if layer.gate_up.bias is not None:
        tensors.update(_split(layer.gate_up.bias, inter, [f"{n}.bias" for n in gate_up]))
    tensors[f"{mlp}down_proj.weight"] = dense_weight(layer.down)
    if layer.down.bias is not None:
        tensors[f"{mlp}down_proj.bias"] = layer.down.bias
    prefix = layer_prefix(index)
    return {prefix + name: tensor.contiguous() for name, tensor in tensors.items()}


def model_piece(model: Model, piece: WeightPiece) -> list[tuple[str, torch.Tensor]]:
    """The piece's tensors in wire order (`replicas.loading.pieces.piece_shapes`), shapes checked.
    Raises `ValueError` when the model lacks the piece or disagrees with its own config."""
    shapes = piece_shapes(model.config, piece)
    match piece.kind:
        case "embeddings":
            found = {name: model.embed_tokens for name in shapes}
        case "norm":
            if model.final_norm is None:
                raise ValueError(f"the final norm of {model.name!r} is not loaded")
            found = {name: model.final_norm for name in shapes}
        case "head":
            if model.lm_head is None:
                raise ValueError(f"the output head of {model.name!r} is not loaded")
            found = {name: dense_weight(model.lm_head) for name in shapes}
        case "layer":
            assert piece.layer is not None
            found = layer_tensors(model, piece.layer)
    if set(found) != set(shapes):
        raise ValueError(
            f"{model.name!r} {piece.label}: holds tensors {sorted(found)}, its config implies {sorted(shapes)}"
        )
    ordered = []
    for name, shape in shapes.items():
        tensor = found[name]
        if tuple(tensor.shape) != shape or tensor.dtype != model.dtype:
            raise ValueError(
                f"{model.name!r} {name}: {list(tensor.shape)} {tensor.dtype}, expected {list(shape)} {model.dtype}"
            )
        ordered.append((name, tensor.contiguous()))
    return ordered
