"""GGUF files (llama.cpp's one-file checkpoints) read as an HF checkpoint: config, tensors, conversion.

`GGUFFile` reads the file with the `gguf` package (`GGUFReader`, memory-mapped). `hf_config()` builds
the `config.json` the metadata implies (`{arch}.block_count`, `embedding_length`, `feed_forward_length`,
`attention.head_count`, `attention.head_count_kv`, `attention.layer_norm_rms_epsilon`, `rope.freq_base`,
`context_length`, `vocab_size`; tied embeddings when the file has no `output.weight`). `hf_tensor()`
gives a tensor (named by `hf_names()`) in HF orientation, dequantized (`gguf.quants.dequantize`) to
float32 — float16 and bfloat16 tensors are kept as they are, they are exact already — with llama.cpp's
rotary row permutation of `attn_q` / `attn_k` undone for the `llama` architecture (its converter
interleaves each head's two rotary halves; zigzag, like HF, rotates halves). `write_checkpoint` writes
the whole HF checkpoint directory that `ModelLoader` then loads layer by layer like any other, keeping
the file's dtypes: float32, float16 and bfloat16 tensors as they are, quantized ones as the file's
blocks, dequantized to float32 when read (`stored_tensor`, `replicas.model.checkpoint.quantized`) — a
conversion takes about the file's bytes, not four to eight times them.

Architectures: `llama` and `qwen2`. Mixture-of-experts files, per-layer head counts, partial rotary
and llama.cpp's stored rope frequency factors (`rope_freqs.weight`, Llama 3.1-style scaling) are
refused with `UnsupportedModelError`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, final

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

from replicas.model.checkpoint.loader import INDEX_FILE
from replicas.model.checkpoint.quantized import QUANTIZED_KEY, quantized_metadata
from replicas.model.errors import CheckpointError, UnsupportedModelError

GGUF_ARCHITECTURES: Final[dict[str, str]] = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SHARD_BYTES: Final = 2 << 30  # one safetensors file per ~2 GiB of converted weights
_MISSING: Final = object()
_KEPT_TYPES: Final = {GGMLQuantizationType.F16: torch.float16, GGMLQuantizationType.BF16: torch.bfloat16}
_LAYER_TENSORS: Final = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_down.bias": "mlp.down_proj.bias",
}
_OUTER_TENSORS: Final = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Failures of GGUFReader on a file that is not a (complete) GGUF: bad magic or version (ValueError),
# a truncated header (struct / numpy errors), an undecodable string.
_READ_ERRORS: Final = (OSError, ValueError, struct.error, IndexError, KeyError, UnicodeDecodeError)


@final
class GGUFFile:
    """One GGUF file's metadata and tensors (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such GGUF file")
        try:
            self.reader = GGUFReader(self.path)
        except _READ_ERRORS as exc:
            raise CheckpointError(f"{self.path}: not a readable GGUF file: {exc}") from exc
        self._tensors = {tensor.name: tensor for tensor in self.reader.tensors}
        self.architecture = self.string("general.architecture")
        if self.architecture not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{self.path}: general.architecture {self.architecture!r} is not supported; zigzag runs "
                f"GGUF files of {sorted(GGUF_ARCHITECTURES)}"
            )

    # ------------------------------------------------------------------ metadata
    def value(self, key: str, default: Any = _MISSING) -> Any:
        """Metadata value `key` (a number, string, bool or list), or `default` when absent."""
        field = self.reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise CheckpointError(f"{self.path}: metadata key {key!r} is missing")
            return default
        try:
            return field.contents()
        except _READ_ERRORS as exc:
            raise CheckpointError(f"{self.path}: metadata key {key!r} is unreadable: {exc}") from exc

    def string(self, key: str, default: Any = _MISSING) -> Any:
        value = self.value(key, default)
        if value is not default and not isinstance(value, str):
            raise CheckpointError(f"{self.path}: metadata key {key!r} must be a string, got {value!r}")
        return value

    def integer(self, key: str, default: Any = _MISSING) -> Any:
        value = self.value(key, default)
        if value is default:
            return value
        if isinstance(value, list):
            raise UnsupportedModelError(f"{self.path}: per-layer {key!r} ({value[:4]}...) is not supported")
        if not isinstance(value, int) or isinstance(value, bool):
            raise CheckpointError(f"{self.path}: metadata key {key!r} must be an integer, got {value!r}")
        return value

    def number(self, key: str, default: Any = _MISSING) -> Any:
        value = self.value(key, default)
        if value is not default and (not isinstance(value, int | float) or isinstance(value, bool)):
            raise CheckpointError(f"{self.path}: metadata key {key!r} must be a number, got {value!r}")
        return value

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    # ------------------------------------------------------------------ config
    def hf_config(self) -> dict[str, Any]:
        """The `config.json` of this file (see the module docstring)."""
        arch = self.architecture
        if self.integer(f"{arch}.expert_count", 0) > 0:
            raise UnsupportedModelError(f"{self.path}: mixture-of-experts GGUF files are not supported")
        if self.has_tensor("rope_freqs.weight"):
            raise UnsupportedModelError(
                f"{self.path}: rope frequency factors (rope_freqs.weight, Llama 3.1-style rope scaling) "
                "are not supported"
            )
        hidden = self.integer(f"{arch}.embedding_length")
        heads = self.integer(f"{arch}.attention.head_count")
        head_dim = self.integer(f"{arch}.attention.key_length", hidden // heads)
        rotary = self.integer(f"{arch}.rope.dimension_count", head_dim)
        if rotary != head_dim:
            raise UnsupportedModelError(
                f"{self.path}: partial rotary ({arch}.rope.dimension_count {rotary} of head_dim {head_dim}) "
                "is not supported"
            )
        tokens = self.value("tokenizer.ggml.tokens", [])
        config: dict[str, Any] = {
            "architectures": [GGUF_ARCHITECTURES[arch]],
            "model_type": arch,
            "hidden_act": "silu",
            "vocab_size": self.integer(f"{arch}.vocab_size", len(tokens)),
            "hidden_size": hidden,
            "intermediate_size": self.integer(f"{arch}.feed_forward_length"),
            "num_hidden_layers": self.integer(f"{arch}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self.integer(f"{arch}.attention.head_count_kv", heads),
            "head_dim": head_dim,
            "max_position_embeddings": self.integer(f"{arch}.context_length", 2048),
            "rms_norm_eps": self.number(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": self.number(f"{arch}.rope.freq_base", 10000.0),
            "tie_word_embeddings": not self.has_tensor("output.weight"),
            "dtype": self._dtype(),
            "bos_token_id": self.integer("tokenizer.ggml.bos_token_id", None),
            "eos_token_id": self.integer("tokenizer.ggml.eos_token_id", None),
        }
        if arch == "llama":
            config["attention_bias"] = self.has_tensor("blk.0.attn_q.bias")
            config["mlp_bias"] = self.has_tensor("blk.0.ffn_up.bias")
        scaling = self.string(f"{arch}.rope.scaling.type", "none")
        if scaling == "linear":
            config["rope_scaling"] = {
                "rope_type": "linear",
                "factor": self.number(f"{arch}.rope.scaling.factor"),
            }
        elif scaling != "none":
            raise UnsupportedModelError(f"{self.path}: rope scaling type {scaling!r} is not supported")
        return config

    def eos_token_ids(self) -> list[int]:
        """What ends a generation: llama.cpp's end-of-generation ids (eos, end of turn, end of message)."""
        keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        found = [self.integer(key, None) for key in keys]
        return list(dict.fromkeys(token for token in found if token is not None))

    def _dtype(self) -> str:
        """float16 / bfloat16 when every matrix is stored so, else float32 (dequantized weights)."""
        kinds = {tensor.tensor_type for tensor in self._tensors.values() if len(tensor.shape) > 1}
        if len(kinds) == 1 and next(iter(kinds)) in _KEPT_TYPES:
            return str(_KEPT_TYPES[next(iter(kinds))]).removeprefix("torch.")
        return "float32"

    # ------------------------------------------------------------------ tensors
    def hf_names(self) -> list[tuple[str, str]]:
        """(GGUF name, HF name) of every tensor zigzag loads, in checkpoint order."""
        config_layers = self.integer(f"{self.architecture}.block_count")
        names = [("token_embd.weight", _OUTER_TENSORS["token_embd.weight"])]
        for index in range(config_layers):
            for short, hf in _LAYER_TENSORS.items():
                if short.endswith(".weight") or self.has_tensor(f"blk.{index}.{short}"):  # biases optional
                    names.append((f"blk.{index}.{short}", f"model.layers.{index}.{hf}"))
        names.append(("output_norm.weight", _OUTER_TENSORS["output_norm.weight"]))
        if self.has_tensor("output.weight"):
            names.append(("output.weight", _OUTER_TENSORS["output.weight"]))
        missing = [gguf_name for gguf_name, _ in names if not self.has_tensor(gguf_name)]
        if missing:
            raise CheckpointError(f"{self.path}: tensor {missing[0]!r} is missing")
        return names

    def hf_tensor(self, gguf_name: str) -> torch.Tensor:
        """Tensor `gguf_name` in HF orientation `[out, in]`, dequantized, rotary permutation undone."""
        tensor = self._tensors[gguf_name]
        shape = tuple(int(n) for n in reversed(tensor.shape))
        kept = _KEPT_TYPES.get(tensor.tensor_type)
        try:
            if kept is not None:
                raw = np.ascontiguousarray(tensor.data).view(
                    np.uint16 if kept is torch.bfloat16 else np.float16
                )
                values = torch.from_numpy(raw.copy()).reshape(shape)
                values = values.view(torch.bfloat16) if kept is torch.bfloat16 else values
            else:
                array = np.asarray(
                    dequantize(tensor.data, GGMLQuantizationType(tensor.tensor_type)), np.float32
                )
                writable = array if array.flags.writeable and array.flags.c_contiguous else array.copy()
                values = torch.from_numpy(writable).reshape(shape)
        except (NotImplementedError, ValueError, RuntimeError) as exc:
            kind = getattr(tensor.tensor_type, "name", tensor.tensor_type)
            raise UnsupportedModelError(f"{self.path}: tensor {gguf_name!r} of type {kind}: {exc}") from exc
        if self.architecture == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            values = unpermute_rotary(values, self._rotary_groups(gguf_name))
        return values

    def quantized(self, gguf_name: str) -> bool:
        """Whether `gguf_name` is stored in blocks of a quantized type (not float32/16, bfloat16)."""
        kind = self._tensors[gguf_name].tensor_type
        return kind not in _KEPT_TYPES and kind != GGMLQuantizationType.F32

    def stored_tensor(self, gguf_name: str) -> tuple[torch.Tensor, str | None]:
        """`gguf_name` as the converted checkpoint stores it, and its GGML type name when quantized
        (None otherwise): a quantized tensor as its `uint8` rows of blocks, rotary rows unpermuted;
        any other as `hf_tensor` gives it."""
        if not self.quantized(gguf_name):
            return self.hf_tensor(gguf_name), None
        tensor = self._tensors[gguf_name]
        blocks = np.ascontiguousarray(tensor.data).view(np.uint8)
        blocks = blocks.reshape(int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1, -1)
        values = torch.from_numpy(blocks.copy())
        if self.architecture == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            values = unpermute_rotary(values, self._rotary_groups(gguf_name))
        return values, GGMLQuantizationType(tensor.tensor_type).name

    def hf_shape(self, gguf_name: str) -> tuple[int, ...]:
        """`gguf_name`'s shape in HF orientation."""
        return tuple(int(n) for n in reversed(self._tensors[gguf_name].shape))

    def _rotary_groups(self, gguf_name: str) -> int:
        arch = self.architecture
        heads = self.integer(f"{arch}.attention.head_count")
        return heads if ".attn_q." in gguf_name else self.integer(f"{arch}.attention.head_count_kv", heads)

    def stored_bytes(self, gguf_name: str) -> int:
        """Bytes `gguf_name` takes once converted: the file's own for quantized and 16-bit tensors,
        float32's otherwise."""
        tensor = self._tensors[gguf_name]
        if self.quantized(gguf_name):
            return int(tensor.n_bytes)
        return int(tensor.n_elements) * (2 if tensor.tensor_type in _KEPT_TYPES else 4)


def unpermute_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute(w, n_head, n_head_kv)`: per head, rows `(2, d/2)` were interleaved to
    `(d/2, 2)`; put them back. Works for weights `[rows, in]` and biases `[rows]`."""
    rows = weight.shape[0]
    if rows % (2 * heads):
        raise CheckpointError(f"rotary rows {rows} do not split into {heads} heads of even size")
    half = rows // heads // 2
    tail = tuple(weight.shape[1:])
    return weight.reshape(heads, half, 2, *tail).transpose(1, 2).reshape(rows, *tail).contiguous()


def write_checkpoint(
    file: GGUFFile,
    directory: Path,
    extra_files: dict[str, str],
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Write `file` as an HF checkpoint into the existing, empty `directory`: `config.json`,
    `generation_config.json`, safetensors weights (one file, or ~2 GiB shards with an index) and
    `extra_files` (name → text: the tokenizer's files). `progress(done, total)` after each tensor read,
    in stored bytes."""
    config = file.hf_config()
    shards = _plan_shards(file)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map: dict[str, str] = {}
    total = sum(file.stored_bytes(gguf_name) for shard in shards for gguf_name, _ in shard)
    done = 0
    for shard, shard_name in zip(shards, names):
        tensors: dict[str, torch.Tensor] = {}
        quantized: dict[str, tuple[str, tuple[int, ...]]] = {}
        for gguf_name, hf_name in shard:
            tensors[hf_name], kind = file.stored_tensor(gguf_name)
            if kind is not None:
                quantized[hf_name] = (kind, file.hf_shape(gguf_name))
            done += file.stored_bytes(gguf_name)
            if progress is not None:
                progress(done, total)
        metadata = {"format": "pt"}
        if quantized:
            metadata[QUANTIZED_KEY] = quantized_metadata(quantized)
        save_file(tensors, str(directory / shard_name), metadata=metadata)
        weight_map.update(dict.fromkeys(tensors, shard_name))
        del tensors
    if len(shards) > 1:
        _write_json(directory / INDEX_FILE, {"metadata": {}, "weight_map": weight_map})
    _write_json(directory / "config.json", config)
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": file.eos_token_ids()}
    _write_json(directory / "generation_config.json", generation)
    for name, text in extra_files.items():
        (directory / name).write_text(text, encoding="utf-8")


def _plan_shards(file: GGUFFile) -> list[list[tuple[str, str]]]:
    shards: list[list[tuple[str, str]]] = [[]]
    size = 0
    for gguf_name, hf_name in file.hf_names():
        nbytes = file.stored_bytes(gguf_name)
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((gguf_name, hf_name))
        size += nbytes
    return shards


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
