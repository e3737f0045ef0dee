"""The weights of one decoder layer and the element-wise pieces of a layer (norm, MLP).

Weights are stored fused where that saves a matrix product: q, k and v projections as one
`[q + 2 kv, hidden]` matrix, gate and up projections as one `[2 intermediate, hidden]` matrix, each a
`Linear` (which picks the kernel). They are read-only after loading, so any number of threads may run
layers concurrently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

import torch

from replicas.model.config import ModelConfig
from replicas.model.linear import Kernels, Linear


@final
@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer, in the model's dtype and on its device."""

    input_norm: torch.Tensor
    qkv: Linear
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear

    def clone(self) -> LayerWeights:
        """A copy in memory of its own, in the same layout (see `Linear.clone`)."""
        return LayerWeights(
            input_norm=self.input_norm.clone(),
            qkv=self.qkv.clone(),
            o=self.o.clone(),
            post_norm=self.post_norm.clone(),
            gate_up=self.gate_up.clone(),
            down=self.down.clone(),
        )

    def nbytes(self) -> int:
        norms = (self.input_norm.numel() + self.post_norm.numel()) * self.input_norm.element_size()
        return norms + sum(p.nbytes for p in (self.qkv, self.o, self.gate_up, self.down))


def packed_layer(layer: LayerWeights, kernels: Kernels) -> LayerWeights | None:
    """`layer` with its plain projections packed as `kernels` asks (`Linear` decides per weight, as at a
    load), its small tensors cloned out of a piece buffer they shared with the weights; None when
    nothing would change (the kernels are plain, the weights are not CPU float32, or already packed).
    A replica's own weight copy installs its layers plain and packs them afterwards, off the copy's path
    (`replicas.actor.loader`); the packed weight is an exact reordering of the plain one."""
    if kernels == "plain":
        return None
    linears = {}
    for name in ("qkv", "o", "gate_up", "down"):
        linear: Linear = getattr(layer, name)
        linears[name] = linear if linear.packed else Linear(linear.weight, linear.bias, kernels=kernels)
    if all(linears[name] is getattr(layer, name) or not linears[name].packed for name in linears):
        return None
    return _own_storage(
        LayerWeights(
            input_norm=layer.input_norm,
            qkv=linears["qkv"],
            o=linears["o"],
            post_norm=layer.post_norm,
            gate_up=linears["gate_up"],
            down=linears["down"],
        )
    )


def expected_layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor names (relative to `model.layers.{i}.`) and their shapes; biases only where the config has them."""
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (config.q_size, hidden),
        "self_attn.k_proj.weight": (config.kv_size, hidden),
        "self_attn.v_proj.weight": (config.kv_size, hidden),
        "self_attn.o_proj.weight": (hidden, config.q_size),
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    if config.qkv_bias:
        shapes["self_attn.q_proj.bias"] = (config.q_size,)
        shapes["self_attn.k_proj.bias"] = (config.kv_size,)
        shapes["self_attn.v_proj.bias"] = (config.kv_size,)
    if config.o_bias:
        shapes["self_attn.o_proj.bias"] = (hidden,)
    if config.mlp_bias:
        shapes["mlp.gate_proj.bias"] = (inter,)
        shapes["mlp.up_proj.bias"] = (inter,)
        shapes["mlp.down_proj.bias"] = (hidden,)
    return shapes


def fuse_layer(
    tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device, *, kernels: Kernels = "auto"
) -> LayerWeights:
    """Build `LayerWeights` from HF-named tensors (shapes already checked against `expected_layer_shapes`)."""

    def get(name: str) -> torch.Tensor:
        return tensors[name].to(device=device, dtype=dtype).contiguous()

    def cat(*names: str) -> torch.Tensor | None:
        if names[0] not in tensors:
            return None
        parts = [tensors[n] for n in names]
        joined = _joined(parts, dtype, device)
        if joined is not None:
            return joined
        return torch.cat([part.to(dtype=dtype) for part in parts], dim=0).to(device).contiguous()

    def optional(name: str) -> torch.Tensor | None:
        return get(name) if name in tensors else None

    def linear(weight: torch.Tensor | None, bias: torch.Tensor | None) -> Linear:
        assert weight is not None
        return Linear(weight, bias, kernels=kernels)

    attn = "self_attn."
    return _own_storage(
        LayerWeights(
            input_norm=get("input_layernorm.weight"),
            qkv=linear(
                cat(f"{attn}q_proj.weight", f"{attn}k_proj.weight", f"{attn}v_proj.weight"),
                cat(f"{attn}q_proj.bias", f"{attn}k_proj.bias", f"{attn}v_proj.bias"),
            ),
            o=linear(get(f"{attn}o_proj.weight"), optional(f"{attn}o_proj.bias")),
            post_norm=get("post_attention_layernorm.weight"),
            gate_up=linear(
                cat("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                cat("mlp.gate_proj.bias", "mlp.up_proj.bias"),
            ),
            down=linear(get("mlp.down_proj.weight"), optional("mlp.down_proj.bias")),
        )
    )


def _joined(parts: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """`parts` as one tensor along rows without a copy, when they lie back to back in one storage, in
    `dtype` on `device` (a peer copy's piece buffer: the checkpoint's q, k, v — or gate, up — tensors
    are the fused matrix's rows, in order); None otherwise."""
    first = parts[0]
    storage, at = first.untyped_storage().data_ptr(), first.storage_offset()
    for part in parts:
        if (
            part.dtype != dtype
            or part.device != device
            or not part.is_contiguous()
            or part.untyped_storage().data_ptr() != storage
            or part.storage_offset() != at
        ):
            return None
        at += part.numel()
    rows = sum(int(part.shape[0]) for part in parts)
    return torch.as_strided(first, (rows, *first.shape[1:]), first.stride(), first.storage_offset())


def _own_storage(layer: LayerWeights) -> LayerWeights:
    """`layer` with each plain tensor that is a small view of a larger storage (a peer copy's piece
    buffer, whose large weights were packed into storage of their own) cloned out of it, so that the
    buffer is freed; tensors that use most of their storage stay views."""
    plain = {
        "input_norm": layer.input_norm,
        "post_norm": layer.post_norm,
        **{
            f"{n}.weight": getattr(layer, n).weight
            for n in ("qkv", "o", "gate_up", "down")
            if not getattr(layer, n).packed
        },
        **{
            f"{n}.bias": b
            for n in ("qkv", "o", "gate_up", "down")
            if (b := getattr(layer, n).bias) is not None
        },
    }
    used: dict[int, int] = {}
    for tensor in plain.values():
        key = tensor.untyped_storage().data_ptr()
        used[key] = used.get(key, 0) + tensor.numel() * tensor.element_size()
    wasted = {k for k, n in used.items() if 2 * n < _storage_bytes(plain, k)}
    if not wasted:
        return layer

    def own(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone() if tensor.untyped_storage().data_ptr() in wasted else tensor

    def own_linear(linear: Linear) -> Linear:
        if not linear.packed:
            linear.weight = own(linear.weight)
        if linear.bias is not None:
            linear.bias = own(linear.bias)
        return linear

    return LayerWeights(
        input_norm=own(layer.input_norm),
        qkv=own_linear(layer.qkv),
        o=own_linear(layer.o),
        post_norm=own(layer.post_norm),
        gate_up=own_linear(layer.gate_up),
        down=own_linear(layer.down),
    )


def _storage_bytes(tensors: dict[str, torch.Tensor], key: int) -> int:
    return next(
        t.untyped_storage().nbytes() for t in tensors.values() if t.untyped_storage().data_ptr() == key
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back before the weight, as HF's LlamaRMSNorm does."""
    if x.dtype == torch.float32:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    x32 = x.to(torch.float32)
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
