"""The typed model configuration, parsed from an HF `config.json` or built in (the tiny model).

Both spellings of the rotary settings are accepted: the older top-level `rope_theta` plus `rope_scaling`
(with `type` or `rope_type`), and the newer `rope_parameters` dict (transformers 5). Anything zigzag does
not run — another architecture, an activation other than SiLU, sliding-window attention, a rope type
other than default/linear/llama3 — is refused with `UnsupportedModelError` naming the file and value.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, final

import msgspec

from replicas.model.errors import CheckpointError, UnsupportedModelError

ModelDType = Literal["float32", "bfloat16", "float16"]
Architecture = Literal["llama", "qwen2", "tiny"]
RopeScaling = Literal["default", "linear", "llama3"]

SUPPORTED_ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_MODEL_TYPES: dict[str, Architecture] = {"llama": "llama", "qwen2": "qwen2"}
_DTYPE_ALIASES: dict[str, ModelDType] = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
}


@final
class RopeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Rotary embedding settings. `mrope_section` (three counts of frequency pairs, summing to
    `head_dim // 2`) turns on 3-D (t, h, w) positions; without it positions are 1-D."""

    theta: float = 10000.0
    scaling: RopeScaling = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    mrope_section: tuple[int, int, int] | None = None


@final
class ModelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the decoder needs to know; every derived size is a property."""

    architecture: Architecture
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    rope: RopeConfig = RopeConfig()
    dtype: ModelDType = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    image_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
            if getattr(self, name) < 1:
                raise UnsupportedModelError(f"model config: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"model config: num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        if self.head_dim < 2 or self.head_dim % 2:
            raise UnsupportedModelError(f"model config: head_dim must be even and >= 2, got {self.head_dim}")
        section = self.rope.mrope_section
        if section is not None and sum(section) != self.head_dim // 2:
            raise UnsupportedModelError(
                f"model config: mrope_section {list(section)} must sum to head_dim / 2 = {self.head_dim // 2}"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def position_axes(self) -> int:
        """1 for text-only rotary positions, 3 for (t, h, w) multimodal ones."""
        return 1 if self.rope.mrope_section is None else 3

    def parameter_count(self) -> int:
        per_layer = (
            self.hidden_size * (self.q_size + 2 * self.kv_size)
            + self.q_size * self.hidden_size
            + 3 * self.hidden_size * self.intermediate_size
            + 2 * self.hidden_size
        )
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.vocab_size * self.hidden_size + self.num_layers * per_layer + self.hidden_size + head


def read_hf_config(path: str | Path) -> ModelConfig:
    """Parse `path` (a `config.json`, or a directory holding one) into a `ModelConfig`."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (a checkpoint directory needs config.json)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not readable as JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return parse_hf_config(raw, source=str(path))


def parse_hf_config(raw: Mapping[str, Any], *, source: str = "config.json") -> ModelConfig:
    """The `ModelConfig` of an HF config dict; `source` names the file in error messages."""
    fields = _Fields(raw, source)
    architecture = _architecture(raw, source)
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise UnsupportedModelError(f"{source}: hidden_act {hidden_act!r} is not supported (only 'silu')")
    if raw.get("use_sliding_window"):
        raise UnsupportedModelError(f"{source}: use_sliding_window=true is not supported")
    hidden = fields.positive_int("hidden_size")
    heads = fields.positive_int("num_attention_heads")
    kv_heads = fields.positive_int("num_key_value_heads", default=heads)
    head_dim = fields.positive_int("head_dim", default=hidden // heads)
    if architecture == "llama":
        qkv_bias = o_bias = bool(raw.get("attention_bias", False))
        mlp_bias = bool(raw.get("mlp_bias", False))
    else:
        qkv_bias, o_bias, mlp_bias = True, False, False
    max_positions = fields.positive_int("max_position_embeddings", default=2048)
    return ModelConfig(
        architecture=architecture,
        vocab_size=fields.positive_int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=fields.positive_int("intermediate_size"),
        num_layers=fields.positive_int("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rms_norm_eps=fields.positive_float("rms_norm_eps", default=1e-6),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rope=_rope(raw, source, max_positions),
        dtype=_dtype(raw, source),
        bos_token_id=fields.optional_int("bos_token_id"),
        eos_token_ids=fields.int_list("eos_token_id"),
    )


def _architecture(raw: Mapping[str, Any], source: str) -> Architecture:
    architectures = raw.get("architectures")
    if architectures:
        if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
            raise CheckpointError(f"{source}: architectures must be a list of names, got {architectures!r}")
        for name in architectures:
            if name in SUPPORTED_ARCHITECTURES:
                return SUPPORTED_ARCHITECTURES[name]
        raise UnsupportedModelError(
            f"{source}: unsupported architectures {architectures}; zigzag runs "
            f"{sorted(SUPPORTED_ARCHITECTURES)}"
        )
    model_type = raw.get("model_type")
    if model_type in SUPPORTED_MODEL_TYPES:
        return SUPPORTED_MODEL_TYPES[model_type]
    raise UnsupportedModelError(
        f"{source}: unsupported model_type {model_type!r}; zigzag runs {sorted(SUPPORTED_MODEL_TYPES)}"
    )


def _dtype(raw: Mapping[str, Any], source: str) -> ModelDType:
    name = raw.get("dtype", raw.get("torch_dtype")) or "float32"
    if not isinstance(name, str) or name.removeprefix("torch.") not in _DTYPE_ALIASES:
        raise UnsupportedModelError(f"{source}: dtype {name!r} is not supported (float32, bfloat16, float16)")
    return _DTYPE_ALIASES[name.removeprefix("torch.")]


def _rope(raw: Mapping[str, Any], source: str, max_positions: int) -> RopeConfig:
    params = raw.get("rope_parameters")
    if params is None:
        params = raw.get("rope_scaling")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise CheckpointError(f"{source}: rope_parameters/rope_scaling must be an object, got {params!r}")
    if any(isinstance(value, dict) for value in params.values()):
        raise UnsupportedModelError(f"{source}: per-layer-type rope_parameters are not supported")
    fields = _Fields(params, f"{source} (rope)")
    theta_raw = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if not isinstance(theta_raw, int | float) or isinstance(theta_raw, bool) or theta_raw <= 0:
        raise CheckpointError(f"{source}: rope_theta must be a positive number, got {theta_raw!r}")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise UnsupportedModelError(f"{source}: partial_rotary_factor {partial!r} is not supported")
    kind = params.get("rope_type", params.get("type", "default"))
    section = params.get("mrope_section")
    mrope: tuple[int, int, int] | None = None
    if kind == "mrope":
        kind = "default"
    if section is not None:
        if not (isinstance(section, list) and len(section) == 3 and all(isinstance(s, int) for s in section)):
            raise CheckpointError(f"{source}: mrope_section must be three integers, got {section!r}")
        mrope = (section[0], section[1], section[2])
    if kind == "default":
        return RopeConfig(theta=float(theta_raw), mrope_section=mrope)
    if kind == "linear":
        return RopeConfig(
            theta=float(theta_raw),
            scaling="linear",
            factor=fields.positive_float("factor"),
            mrope_section=mrope,
        )
    if kind == "llama3":
        return RopeConfig(
            theta=float(theta_raw),
            scaling="llama3",
            factor=fields.positive_float("factor"),
            low_freq_factor=fields.positive_float("low_freq_factor"),
            high_freq_factor=fields.positive_float("high_freq_factor"),
            original_max_position_embeddings=fields.positive_int(
                "original_max_position_embeddings",
                default=raw.get("original_max_position_embeddings", max_positions),
            ),
            mrope_section=mrope,
        )
    raise UnsupportedModelError(
        f"{source}: rope type {kind!r} is not supported (default, linear, llama3, mrope)"
    )


@final
class _Fields:
    """Typed reads from a JSON object, raising `CheckpointError` that names the file and field."""

    def __init__(self, raw: Mapping[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    def positive_int(self, key: str, default: object = None) -> int:
        value = self.raw.get(key, default)
        if value is None and default is not None:
            value = default
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CheckpointError(f"{self.source}: field {key!r} must be a positive integer, got {value!r}")
        return value

    def positive_float(self, key: str, default: float | None = None) -> float:
        value = self.raw.get(key, default)
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise CheckpointError(f"{self.source}: field {key!r} must be a positive number, got {value!r}")
        return float(value)

    def optional_int(self, key: str) -> int | None:
        value = self.raw.get(key)
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool):
            raise CheckpointError(f"{self.source}: field {key!r} must be an integer or null, got {value!r}")
        return value

    def int_list(self, key: str) -> tuple[int, ...]:
        value = self.raw.get(key)
        if value is None:
            return ()
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(item, int) and not isinstance(item, bool) for item in items):
            raise CheckpointError(
                f"{self.source}: field {key!r} must be an integer or a list of them, got {value!r}"
            )
        return tuple(items)
