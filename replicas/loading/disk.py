"""Reading a checkpoint piece by piece from its safetensors files (`CheckpointFiles`).

Each tensor's presence and shape is checked from the file header before it is read. Tensors come out
on the CPU in the serving dtype, in memory of their own: safetensors maps the file, and a tensor read
from it would change if the file were rewritten in place, so one already in the serving dtype is
copied out of the mapping. Blocking (file reads): call it from a worker thread; a piece is read whole
or not at all (cancellation waits for the thread, `replicas.loading.sources`).
"""

from __future__ import annotations

from pathlib import Path
from typing import final

import torch

from messages.weights import WeightPiece
from replicas.loading.pieces import piece_shapes
from replicas.model.checkpoint.loader import CheckpointFiles
from replicas.model.config import ModelConfig
from transport.memory.storage import torch_dtype


@final
class DiskReader:
    """The pieces of the checkpoint in `directory` (see the module docstring). Raises the loader's
    `CheckpointError` / `WeightShapeError` naming the file and tensor; `close` drops the file handles."""

    def __init__(self, directory: Path, config: ModelConfig) -> None:
        self.directory = directory
        self.config = config
        self.dtype = torch_dtype(config.dtype)
        self._files: CheckpointFiles | None = None

    def read(self, piece: WeightPiece) -> dict[str, torch.Tensor]:
        if self._files is None:
            self._files = CheckpointFiles(self.directory)
        files = self._files
        return {
            name: files.read(name, shape).to(dtype=self.dtype, copy=True).contiguous()
            for name, shape in piece_shapes(self.config, piece).items()
        }

    def close(self) -> None:
        if self._files is not None:
            self._files.close()
            self._files = None
