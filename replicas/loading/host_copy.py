"""The node's host-memory copy of a model: one per node process and model, whatever the replicas.

It holds every piece's checkpoint tensors (HF names, unfused) in the serving dtype on the CPU — in
pinned memory when the model serves on CUDA, so copies to the device run at full speed. A model served
on the CPU keeps each layer once: as the node's resident copy fused (and packed) it (`put_fused`); its
unfused tensors are let go, and `read` splits them back out of the fused ones
(`replicas.loading.split`), so the node holds its weights once, not twice. The node fills
it while it first loads the model from disk (`replicas.weights.ModelHost`, or a replica's own copy from
disk when that comes first: `replicas.loading.sources.DiskSource`); it stays when replicas drop
their copies (a replica scaled down to `Inactive`), so a later copy with source `host` reads no file.
Its tensors are read-only: a copy into a replica takes copies of them (`replicas.loading.sources`); the
node's shared resident model on the CPU may use them as they are.

Writers: the node's loads from disk (worker threads; two that overlap put the same tensors, each piece
whole); readers look only at a complete copy. Synchronous: nothing to cancel.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import final

import torch

from messages.weights import WeightPiece
from replicas.loading.pieces import checkpoint_pieces
from replicas.loading.split import fused_layer_tensors
from replicas.model.config import ModelConfig
from replicas.model.layers import LayerWeights


@final
class HostCopy:
    """See the module docstring. `pin`: keep the tensors in pinned memory (a CUDA model)."""

    def __init__(self, config: ModelConfig, *, pin: bool) -> None:
        self.config = config
        self.pin = pin
        self._pieces: dict[WeightPiece, dict[str, torch.Tensor]] = {}
        self._expected = checkpoint_pieces(config)
        self._layer_piece = {piece.layer: piece for piece in self._expected if piece.layer is not None}
        # CPU models: each layer as the node's resident copy fused (and packed) it — the same tensors,
        # kept when that copy is released — so a host copy into a replica is a plain copy of them.
        self._fused: dict[int, LayerWeights] = {}

    @property
    def complete(self) -> bool:
        return len(self._pieces) == len(self._expected)

    @property
    def nbytes(self) -> int:
        unfused = sum(t.numel() * t.element_size() for piece in self._pieces.values() for t in piece.values())
        return unfused + sum(weights.nbytes() for weights in self._fused.values())

    def put(self, piece: WeightPiece, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Keep `piece`'s tensors (CPU, serving dtype; taken as they are unless they must be pinned);
        returns what is kept."""
        kept = {}
        for name, tensor in tensors.items():
            tensor = tensor.to("cpu").contiguous()
            if self.pin and torch.cuda.is_available() and not tensor.is_pinned():
                tensor = tensor.pin_memory()
            kept[name] = tensor
        self._pieces[piece] = kept
        return kept

    def put_fused(self, layer: int, weights: LayerWeights) -> None:
        """Keep layer `layer` as a CPU model serves it (read-only; `LayerWeights.clone` to own it), in
        place of its unfused tensors (once they were put)."""
        if not self.pin:
            self._fused[layer] = weights
            piece = self._layer_piece[layer]
            if piece in self._pieces:
                self._pieces[piece] = {}  # complete still; `read` splits the fused weights

    def fused(self, layer: int) -> LayerWeights | None:
        return self._fused.get(layer)

    def read(self, piece: WeightPiece) -> dict[str, torch.Tensor]:
        """`piece`'s tensors (read-only: copy them to keep them). Raises `KeyError` when absent."""
        tensors = self._pieces[piece]
        fused = None if piece.layer is None else self._fused.get(piece.layer)
        if not tensors and fused is not None:
            assert piece.layer is not None
            return fused_layer_tensors(fused, self.config, piece.layer)
        return dict(tensors)
