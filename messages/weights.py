"""Weights that move (architecture §8): a checkpoint's pieces, and the header of a peer weight transfer.

A model's weights are copied in checkpoint order, one *piece* at a time: the embeddings, each decoder
layer, the final norm, the output head (only when it is not tied to the embeddings). A piece crosses a
peer link as the checkpoint's own tensors (HF names, unfused: `q_proj`, `k_proj`, `v_proj`, ...) in the
serving dtype, packed back to back; `WeightsHeader` is the tensor table that rides, opaque to the
transport (`messages.peer_codec.encode_header`), on every `ChunkDone` of the transfer. A piece larger
than the sender's staging pool travels in several transfers, each carrying bytes
`[offset, offset + nbytes)` of the piece.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from messages.base import Message, Record
from messages.layout import DType

PieceKind = Literal["embeddings", "layer", "norm", "head"]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class WeightPiece(Record, frozen=True):
    """One piece of a checkpoint: `layer` is the decoder layer's index for `kind == "layer"`, else null."""

    kind: PieceKind
    layer: NonNegative | None = None

    def __post_init__(self) -> None:
        if (self.kind == "layer") != (self.layer is not None):
            raise ValueError(f"weight piece {self.kind!r}: a layer index goes with kind 'layer' only")

    @property
    def label(self) -> str:
        """`embeddings`, `layer 3`, `norm`, `head`."""
        return self.kind if self.layer is None else f"layer {self.layer}"


class WeightTensor(Record, frozen=True):
    """One checkpoint tensor of a piece: bytes `[offset, offset + nbytes)` of the piece, row-major."""

    name: str
    dtype: DType
    shape: tuple[NonNegative, ...]
    offset: NonNegative
    nbytes: NonNegative


class WeightsHeader(Message, frozen=True, tag="weights_header"):
    """A peer weight transfer: bytes `[offset, offset + nbytes)` of piece `piece` (of `piece_bytes` in
    all) of model `model`, whose tensors are `tensors` (the whole piece's table, in order)."""

    model: str
    piece: WeightPiece
    piece_bytes: NonNegative
    offset: NonNegative
    nbytes: NonNegative
    tensors: tuple[WeightTensor, ...]
