"""Quantized GGUF tensors kept in a converted checkpoint as the file's own blocks, dequantized when read.

A GGUF file's quantized tensors (Q4_1, Q8_0, …) cannot be served as they are; dequantized to float32 they
take four to eight times the file's bytes. The conversion (`replicas.model.checkpoint.gguf`) therefore
writes each as its rows of blocks — a `uint8` tensor `[rows, bytes per row]`, the llama rotary row
permutation already undone (rows of blocks move like rows of values) — and names it in the safetensors
file's metadata under `QUANTIZED_KEY`: a JSON object `{hf name: [GGML type name, [rows, columns]]}`.
`CheckpointFiles` (`replicas.model.checkpoint.loader`) checks such a tensor's shape from that entry and
dequantizes it on read with the `gguf` package's own `dequantize`, row by row — the float32 values
transformers computes from the same file. Float32, float16 and bfloat16 tensors are stored as they are.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Final

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from replicas.model.errors import CheckpointError

QUANTIZED_KEY: Final = "zigzag.gguf_quantized"


def quantized_entries(
    metadata: Mapping[str, str] | None, where: str
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The quantized tensors a safetensors file's metadata names: hf name → (type name, logical shape)."""
    text = (metadata or {}).get(QUANTIZED_KEY)
    if text is None:
        return {}
    try:
        raw = json.loads(text)
        return {str(name): (str(kind), tuple(int(n) for n in shape)) for name, (kind, shape) in raw.items()}
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{where}: metadata {QUANTIZED_KEY!r} is not readable: {exc}") from exc


def quantized_metadata(entries: Mapping[str, tuple[str, tuple[int, ...]]]) -> str:
    return json.dumps({name: [kind, list(shape)] for name, (kind, shape) in entries.items()})


def dequantize_stored(blocks: torch.Tensor, kind: str, shape: tuple[int, ...], where: str) -> torch.Tensor:
    """The float32 tensor of shape `shape` that `blocks` (`uint8`, rows of GGML `kind` blocks) holds."""
    try:
        quant = GGMLQuantizationType[kind]
        values = dequantize(blocks.numpy(), quant)
    except (KeyError, NotImplementedError, ValueError) as exc:
        raise CheckpointError(f"{where}: cannot dequantize its {kind} blocks: {exc!r}") from exc
    array = np.ascontiguousarray(values, dtype=np.float32)
    if array.size != int(np.prod(shape)):
        raise CheckpointError(f"{where}: {kind} blocks hold {array.size} values, not {list(shape)}")
    return torch.from_numpy(array).reshape(shape)
