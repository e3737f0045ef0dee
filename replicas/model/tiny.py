"""The built-in `tiny` model: seeded weights, byte tokenizer, 3-D rotary positions, a vision encoder.

Same seed → same weights on every machine: every tensor is drawn in float32 on CPU from one
`torch.Generator`, in a fixed order, then cast and moved. The output head is scaled so logits are sharp
(top-2 gaps of several units), which keeps greedy ties — and so replica-to-replica differences — rare.
About 0.66 M parameters (2.6 MB in float32); a context of 32 768 tokens.
"""

from __future__ import annotations

import math

import msgspec
import torch

from replicas.model.config import ModelConfig, ModelDType, RopeConfig
from replicas.model.layers import fuse_layer
from replicas.model.linear import Kernels
from replicas.model.llama import Model
from replicas.model.text.tokenizer import ByteTokenizer
from replicas.model.vision import VisionConfig, VisionEncoder

TINY_SEED = 20240531
# The tiny model's chat template (it has no checkpoint to carry one): role tags around each message.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

TINY_CONFIG = ModelConfig(
    architecture="tiny",
    vocab_size=260,
    hidden_size=128,
    intermediate_size=256,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    qkv_bias=True,
    rope=RopeConfig(theta=1_000_000.0, mrope_section=(4, 6, 6)),
    dtype="float32",
    bos_token_id=ByteTokenizer.BOS,
    eos_token_ids=(ByteTokenizer.EOS,),
    image_token_id=ByteTokenizer.IMAGE,
)


def tiny_tensors(seed: int = TINY_SEED) -> tuple[dict[str, torch.Tensor], int]:
    """The tiny model's checkpoint: its decoder tensors under their HF names (float32, CPU), and the seed
    of its vision encoder (drawn from the same generator after the weights)."""
    config = TINY_CONFIG
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float32) * std

    hidden, inter = config.hidden_size, config.intermediate_size
    tensors = {"model.embed_tokens.weight": normal(config.vocab_size, hidden, std=1.0)}
    for index in range(config.num_layers):
        layer = {
            "input_layernorm.weight": 1.0 + normal(hidden, std=0.05),
            "self_attn.q_proj.weight": normal(config.q_size, hidden, std=1 / math.sqrt(hidden)),
            "self_attn.k_proj.weight": normal(config.kv_size, hidden, std=1 / math.sqrt(hidden)),
            "self_attn.v_proj.weight": normal(config.kv_size, hidden, std=1 / math.sqrt(hidden)),
            "self_attn.q_proj.bias": normal(config.q_size, std=0.1),
            "self_attn.k_proj.bias": normal(config.kv_size, std=0.1),
            "self_attn.v_proj.bias": normal(config.kv_size, std=0.1),
            "self_attn.o_proj.weight": normal(hidden, config.q_size, std=0.5 / math.sqrt(config.q_size)),
            "post_attention_layernorm.weight": 1.0 + normal(hidden, std=0.05),
            "mlp.gate_proj.weight": normal(inter, hidden, std=1 / math.sqrt(hidden)),
            "mlp.up_proj.weight": normal(inter, hidden, std=1 / math.sqrt(hidden)),
            "mlp.down_proj.weight": normal(hidden, inter, std=0.5 / math.sqrt(inter)),
        }
        tensors.update({f"model.layers.{index}.{name}": tensor for name, tensor in layer.items()})
    tensors["model.norm.weight"] = 1.0 + normal(hidden, std=0.05)
    tensors["lm_head.weight"] = normal(config.vocab_size, hidden, std=0.5)
    vision_seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator).item())
    return tensors, vision_seed


def tiny_model(
    *,
    seed: int = TINY_SEED,
    dtype: ModelDType = "float32",
    device: str | torch.device = "cpu",
    kernels: Kernels = "auto",
    batch_invariant: bool = False,
) -> Model:
    """Build the tiny model (a few milliseconds; no files); `kernels` as in `replicas.model.linear`,
    `batch_invariant` as in `Model`."""
    if batch_invariant:
        kernels = "plain"
    config = msgspec.structs.replace(TINY_CONFIG, dtype=dtype)
    target = torch.device(device)
    model_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    tensors, vision_seed = tiny_tensors(seed)

    def place(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device=target, dtype=model_dtype).contiguous()

    assert config.image_token_id is not None
    vision = VisionEncoder(
        VisionConfig(out_hidden=config.hidden_size, seed=vision_seed),
        image_token_id=config.image_token_id,
        device=target,
    )
    model = Model(
        config,
        device=target,
        embed_tokens=place(tensors["model.embed_tokens.weight"]),
        tokenizer=ByteTokenizer(config.vocab_size),
        vision=vision,
        name="tiny",
        kernels=kernels,
        batch_invariant=batch_invariant,
    )
    for index in range(config.num_layers):
        prefix = f"model.layers.{index}."
        layer = {name[len(prefix) :]: tensor for name, tensor in tensors.items() if name.startswith(prefix)}
        model.set_layer(index, fuse_layer(layer, model_dtype, target, kernels=kernels))
    model.set_head(place(tensors["model.norm.weight"]), place(tensors["lm_head.weight"]))
    return model
