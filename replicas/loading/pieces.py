"""A checkpoint's pieces in load order, and each piece's tensor table (architecture §8).

Order: the embeddings, decoder layers 0 … L−1, the final norm, the output head — the head only when it
is not tied to the embeddings. A piece's tensors are the checkpoint's own (HF names, unfused), in a fixed
order; `tensor_table` lays them out back to back in the serving dtype, which is how a piece crosses a
peer link (`messages.weights.WeightsHeader`) and how its size is counted. Pure functions of the config
(nothing to cancel).
"""

from __future__ import annotations

from typing import Final

from messages.layout import DTYPE_SIZES
from messages.weights import WeightPiece, WeightTensor
from replicas.model.checkpoint.loader import EMBED, HEAD, NORM
from replicas.model.config import ModelConfig
from replicas.model.layers import expected_layer_shapes

EMBEDDINGS: Final = WeightPiece(kind="embeddings")
NORM_PIECE: Final = WeightPiece(kind="norm")
HEAD_PIECE: Final = WeightPiece(kind="head")


def layer_piece(index: int) -> WeightPiece:
    return WeightPiece(kind="layer", layer=index)


def layer_prefix(index: int) -> str:
    return f"model.layers.{index}."


def checkpoint_pieces(config: ModelConfig) -> list[WeightPiece]:
    """Every piece of `config`'s checkpoint, in load order."""
    pieces = [EMBEDDINGS, *(layer_piece(index) for index in range(config.num_layers)), NORM_PIECE]
    return pieces if config.tie_word_embeddings else [*pieces, HEAD_PIECE]


def piece_shapes(config: ModelConfig, piece: WeightPiece) -> dict[str, tuple[int, ...]]:
    """The piece's tensors (full HF names) and their shapes, in wire order. Raises `ValueError` for a
    piece the config does not have (a layer past the last, a head of tied embeddings)."""
    match piece.kind:
        case "embeddings":
            return {EMBED: (config.vocab_size, config.hidden_size)}
        case "norm":
            return {NORM: (config.hidden_size,)}
        case "head":
            if config.tie_word_embeddings:
                raise ValueError("the model's output head is tied to its embeddings: it has no head piece")
            return {HEAD: (config.vocab_size, config.hidden_size)}
        case "layer":
            assert piece.layer is not None
            if piece.layer >= config.num_layers:
                raise ValueError(f"layer {piece.layer} of a model of {config.num_layers} layers")
            prefix = layer_prefix(piece.layer)
            return {prefix + name: shape for name, shape in expected_layer_shapes(config).items()}


def tensor_table(config: ModelConfig, piece: WeightPiece) -> tuple[WeightTensor, ...]:
    """The piece's tensors back to back in `config.dtype` (offsets and sizes in bytes)."""
    size = DTYPE_SIZES[config.dtype]
    table, offset = [], 0
    for name, shape in piece_shapes(config, piece).items():
        count = 1
        for dim in shape:
            count *= dim
        table.append(
            WeightTensor(name=name, dtype=config.dtype, shape=shape, offset=offset, nbytes=count * size)
        )
        offset += count * size
    return tuple(table)


def piece_bytes(config: ModelConfig, piece: WeightPiece) -> int:
    """The piece's bytes in `config.dtype`."""
    table = tensor_table(config, piece)
    return table[-1].offset + table[-1].nbytes if table else 0


def model_bytes(config: ModelConfig) -> int:
    """Every piece's bytes in `config.dtype`: what a copy moves, and the model's `parameter_bytes()` once
    loaded (but for a tied output head that the CPU kernels packed into a copy of its own)."""
    return sum(piece_bytes(config, piece) for piece in checkpoint_pieces(config))


def relative(piece: WeightPiece, name: str) -> str:
    """A layer tensor's name inside its layer (`self_attn.q_proj.weight`), what `fuse_layer` takes."""
    return name[len(layer_prefix(piece.layer)) :] if piece.layer is not None else name
