"""config.json parsing: both rotary spellings, dtypes, EOS lists."""

from __future__ import annotations

from typing import Any

from replicas.model import RopeConfig, parse_hf_config

BASE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}


def test_old_and_new_rope_spellings_give_the_same_config() -> None:
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    old = parse_hf_config({**BASE, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **scaling}})
    old_named = parse_hf_config(
        {**BASE, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **scaling}}
    )
    new = parse_hf_config(
        {**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **scaling}}
    )
    expected = RopeConfig(
        theta=500000.0,
        scaling="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    assert old.rope == old_named.rope == new.rope == expected


def test_defaults_and_plain_rope() -> None:
    config = parse_hf_config({**BASE, "rope_theta": 1e6, "rope_scaling": None, "eos_token_id": [5, 7]})
    assert config.rope == RopeConfig(theta=1e6)
    assert config.head_dim == 16 and config.position_axes == 1
    assert config.eos_token_ids == (5, 7) and config.dtype == "float32"
    assert (
        parse_hf_config({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}).rope.theta
        == 7.0
    )
    assert parse_hf_config(BASE).rope == RopeConfig()


def test_qwen2_biases_dtype_aliases_and_mrope() -> None:
    raw = {**BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "torch_dtype": "bfloat16"}
    config = parse_hf_config(raw)
    assert (config.architecture, config.qkv_bias, config.o_bias, config.mlp_bias) == (
        "qwen2",
        True,
        False,
        False,
    )
    assert config.dtype == "bfloat16"
    llama = parse_hf_config({**BASE, "attention_bias": True, "mlp_bias": True, "dtype": "float16"})
    assert (llama.qkv_bias, llama.o_bias, llama.mlp_bias, llama.dtype) == (True, True, True, "float16")
    mrope = parse_hf_config({**BASE, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}})
    assert mrope.rope.mrope_section == (2, 3, 3) and mrope.position_axes == 3
