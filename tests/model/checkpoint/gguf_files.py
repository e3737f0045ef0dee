"""Small GGUF files written with `gguf.GGUFWriter` the way llama.cpp's converter writes them, for tests.

`write_gguf` draws HF-layout tensors, permutes `attn_q` / `attn_k` rows as llama.cpp does for the
`llama` architecture, stores one tensor in Q8_0, one in float16 and one in bfloat16, and writes a
byte-level BPE tokenizer. It returns the HF tensors the conversion must give back.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import gguf
import numpy as np
import torch

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 64, 4, 2, 16, 96
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ c", "a t"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
Q8_TENSOR = "model.layers.0.mlp.up_proj.weight"
Q4_TENSOR = "model.layers.0.self_attn.k_proj.weight"  # quantized and rotary-permuted by llama.cpp
F16_TENSOR = "model.layers.1.mlp.down_proj.weight"
BF16_TENSOR = "model.layers.1.mlp.gate_proj.weight"


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    spelled, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelled[byte] = chr(byte)
        else:
            spelled[byte] = chr(256 + extra)
            extra += 1
    return [spelled[byte] for byte in range(256)]


def vocabulary() -> list[str]:
    return [*SPECIALS, *byte_alphabet(), *("".join(m.split(" ")) for m in MERGES)]


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `permute(w, n_head, n_head_kv)` (convert_hf_to_gguf.py), heads already the right count."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def hf_tensors(arch: str, layers: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    vocab = len(vocabulary())

    def draw(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    tensors = {"model.embed_tokens.weight": draw(vocab, HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": 1 + draw(HIDDEN),
            p + "self_attn.q_proj.weight": draw(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": draw(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": draw(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": draw(HIDDEN, HEADS * HEAD_DIM),
            p + "post_attention_layernorm.weight": 1 + draw(HIDDEN),
            p + "mlp.gate_proj.weight": draw(INTER, HIDDEN),
            p + "mlp.up_proj.weight": draw(INTER, HIDDEN),
            p + "mlp.down_proj.weight": draw(HIDDEN, INTER),
        }
        if arch == "qwen2":
            tensors |= {
                p + "self_attn.q_proj.bias": draw(HEADS * HEAD_DIM),
                p + "self_attn.k_proj.bias": draw(KV_HEADS * HEAD_DIM),
                p + "self_attn.v_proj.bias": draw(KV_HEADS * HEAD_DIM),
            }
    tensors["model.norm.weight"] = 1 + draw(HIDDEN)
    if arch == "llama":  # untied head; the qwen2 file ties it
        tensors["lm_head.weight"] = draw(vocab, HIDDEN)
    return tensors


def gguf_name(hf_name: str) -> str:
    renames = [
        ("model.embed_tokens.", "token_embd."),
        ("model.norm.", "output_norm."),
        ("lm_head.", "output."),
        ("model.layers.", "blk."),
        ("input_layernorm", "attn_norm"),
        ("post_attention_layernorm", "ffn_norm"),
        ("self_attn.q_proj", "attn_q"),
        ("self_attn.k_proj", "attn_k"),
        ("self_attn.v_proj", "attn_v"),
        ("self_attn.o_proj", "attn_output"),
        ("mlp.gate_proj", "ffn_gate"),
        ("mlp.up_proj", "ffn_up"),
        ("mlp.down_proj", "ffn_down"),
    ]
    for old, new in renames:
        hf_name = hf_name.replace(old, new)
    return hf_name


def write_gguf(
    path: Path,
    *,
    arch: str = "llama",
    layers: int = 2,
    seed: int = 0,
    drop: Collection[str] = (),
    tokenizer_model: str = "gpt2",
    pre: str = "smollm",
) -> dict[str, torch.Tensor]:
    """Write the file; returns the HF tensors it holds (Q8_0 / 16-bit ones as they round-trip)."""
    tensors = hf_tensors(arch, layers, seed)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(5000.0)
    tokens = vocabulary()
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)
    returned: dict[str, torch.Tensor] = {}
    for hf, value in tensors.items():
        name = gguf_name(hf)
        if name in drop:
            continue
        stored = value
        if arch == "llama" and ".attn_q." in name:
            stored = llama_cpp_permute(value, HEADS)
        elif arch == "llama" and ".attn_k." in name:
            stored = llama_cpp_permute(value, KV_HEADS)
        if hf in (Q8_TENSOR, Q4_TENSOR):
            kind = gguf.GGMLQuantizationType.Q8_0 if hf == Q8_TENSOR else gguf.GGMLQuantizationType.Q4_1
            quantized = gguf.quants.quantize(stored, kind)
            writer.add_tensor(name, quantized, raw_dtype=kind)
            # Rows quantize one by one: the permutation moves them whole.
            unpermuted = gguf.quants.quantize(np.ascontiguousarray(value), kind)
            returned[hf] = torch.from_numpy(gguf.quants.dequantize(unpermuted, kind))
        elif hf == F16_TENSOR:
            writer.add_tensor(name, stored.astype(np.float16))
            returned[hf] = torch.from_numpy(value.astype(np.float16))
        elif hf == BF16_TENSOR:  # bfloat16: the top half of each float32's bits
            bits = (np.ascontiguousarray(stored).view(np.uint32) >> 16).astype(np.uint16)
            writer.add_tensor(name, bits.view(np.uint8), raw_dtype=gguf.GGMLQuantizationType.BF16)
            returned[hf] = torch.from_numpy(
                (value.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)
            ).view(torch.bfloat16)
        else:
            writer.add_tensor(name, np.ascontiguousarray(stored))
            returned[hf] = torch.from_numpy(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return returned
