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
        return torch.cat([tensors[n].to(dtype=dtype) for n in names], dim=0).to(device).contiguous()

    def optional(name: str) -> torch.Tensor | None:
        return get(name) if name in tensors else None

    def linear(weight: torch.Tensor | None, bias: torch.Tensor | None) -> Linear:
        assert weight is not None
        return Linear(weight, bias, kernels=kernels)

    attn = "self_attn."
    return LayerWeights(
        input_norm=get("input_layernorm.weight"),
        qkv=linear(
            cat(f"{attn}q_proj.weight", f"{attn}k_proj.weight", f"{attn}v_proj.weight"),
            cat(f"{attn}q_proj.bias", f"{attn}k_proj.bias", f"{attn}v_proj.bias"),
        ),
        o=linear(get(f"{attn}o_proj.weight"), optional(f"{attn}o_proj.bias")),
        post_norm=get("post_attention_layernorm.weight"),
        gate_up=linear(
            cat("mlp.gate_proj.weight", "mlp.up_proj.weight"), cat("mlp.gate_proj.bias", "mlp.up_proj.bias")
        ),
        down=linear(get("mlp.down_proj.weight"), optional("mlp.down_proj.bias")),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back before the weight, as HF's LlamaRMSNorm does."""
    if x.dtype == torch.float32:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    x32 = x.to(torch.float32)
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
