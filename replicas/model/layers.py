"""The weights of one decoder layer and the element-wise pieces of a layer (norm, MLP).

Weights are stored fused where that saves a matrix product: q, k and v projections as one
`[q + 2 kv, hidden]` matrix, gate and up projections as one `[2 intermediate, hidden]` matrix. They are
read-only after loading, so any number of threads may run layers concurrently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

import torch
import torch.nn.functional as F

from replicas.model.config import ModelConfig


@final
@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer, in the model's dtype and on its device."""

    input_norm: torch.Tensor
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_weight: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor
    down_bias: torch.Tensor | None

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (
                self.input_norm,
                self.qkv_weight,
                self.qkv_bias,
                self.o_weight,
                self.o_bias,
                self.post_norm,
                self.gate_up_weight,
                self.gate_up_bias,
                self.down_weight,
                self.down_bias,
            )
            if t is not None
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


def fuse_layer(tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> LayerWeights:
    """Build `LayerWeights` from HF-named tensors (shapes already checked against `expected_layer_shapes`)."""

    def get(name: str) -> torch.Tensor:
        return tensors[name].to(device=device, dtype=dtype).contiguous()

    def cat(*names: str) -> torch.Tensor | None:
        if names[0] not in tensors:
            return None
        return torch.cat([tensors[n].to(dtype=dtype) for n in names], dim=0).to(device).contiguous()

    def optional(name: str) -> torch.Tensor | None:
        return get(name) if name in tensors else None

    qkv = cat("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
    gate_up = cat("mlp.gate_proj.weight", "mlp.up_proj.weight")
    assert qkv is not None and gate_up is not None
    return LayerWeights(
        input_norm=get("input_layernorm.weight"),
        qkv_weight=qkv,
        qkv_bias=cat("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        o_weight=get("self_attn.o_proj.weight"),
        o_bias=optional("self_attn.o_proj.bias"),
        post_norm=get("post_attention_layernorm.weight"),
        gate_up_weight=gate_up,
        gate_up_bias=cat("mlp.gate_proj.bias", "mlp.up_proj.bias"),
        down_weight=get("mlp.down_proj.weight"),
        down_bias=optional("mlp.down_proj.bias"),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back before the weight, as HF's LlamaRMSNorm does."""
    if x.dtype == torch.float32:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    x32 = x.to(torch.float32)
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def mlp(x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
    """SwiGLU: `down(silu(gate(x)) * up(x))` with gate and up as one matrix product."""
    gate_up = F.linear(x, layer.gate_up_weight, layer.gate_up_bias)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, layer.down_weight, layer.down_bias)
