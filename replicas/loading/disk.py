"""Reading a checkpoint piece by piece from its safetensors files (`CheckpointFiles`).

Each tensor's presence and shape is checked from the file header before it is read. A piece comes out
on the CPU in the serving dtype, its tensors views of one buffer of its own laid out as the piece's
tensor table (`replicas.loading.pieces.tensor_table`: the wire layout of a peer copy too) — on huge
pages where the kernel offers them (`transport.memory.host_memory.landing_buffer`). A tensor stored in
the serving dtype, as it is (not quantized), is read straight from its file into its place in the
buffer with one unbuffered `preadv` (several where the kernel returns less): one copy, from the page
cache, with no mapping and no temporary. Any other (a dtype to convert, a tensor kept quantized) is read
through safetensors and converted into its place. Either way the tensors are in memory of their own —
never a mapping of the file, which would change if the file were rewritten in place. Blocking (file
reads): call it from a worker thread; a piece is read whole or not at all (cancellation waits for the
thread, `replicas.loading.sources`).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Final, final

import torch

from messages.weights import WeightPiece
from replicas.loading.pieces import tensor_table
from replicas.model.checkpoint.loader import CheckpointFiles
from replicas.model.config import ModelConfig
from replicas.model.errors import CheckpointError
from transport.memory.host_memory import landing_buffer
from transport.memory.storage import torch_dtype

# safetensors' names of the serving dtypes
STORED: Final = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


@final
class _File:
    """One safetensors file opened for reads: its descriptor and each tensor's header entry."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        try:
            (length,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
            header = json.loads(os.pread(self.fd, length, 8))
        except (OSError, struct.error, ValueError) as exc:
            os.close(self.fd)
            raise CheckpointError(f"{path}: not a readable safetensors header: {exc}") from exc
        self.data_start = 8 + length
        self.entries: dict[str, dict[str, object]] = {
            name: entry
            for name, entry in header.items()
            if name != "__metadata__" and isinstance(entry, dict)
        }

    def span(self, name: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> int | None:
        """The file offset of tensor `name` when it is stored as `dtype` in `shape` (`nbytes` bytes),
        so its bytes are the serving ones; None otherwise (it must be converted)."""
        entry = self.entries.get(name)
        if entry is None or entry.get("dtype") != STORED.get(dtype) or tuple(entry.get("shape", ())) != shape:  # type: ignore[arg-type]
            return None
        offsets = entry.get("data_offsets")
        if not isinstance(offsets, list) or len(offsets) != 2 or offsets[1] - offsets[0] != nbytes:
            return None
        return self.data_start + int(offsets[0])

    def read_into(self, target: torch.Tensor, at: int) -> None:
        """Fill uint8 CPU tensor `target` with the file's bytes from offset `at`; `CheckpointError`
        when the file ends first."""
        view = memoryview(target.numpy()).cast("B")  # type: ignore[arg-type]
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], at + done)
            if got <= 0:
                raise CheckpointError(f"{self.path}: ends {len(view) - done} bytes before a tensor's end")
            done += got

    def close(self) -> None:
        os.close(self.fd)


@final
class DiskReader:
    """The pieces of the checkpoint in `directory` (see the module docstring). Raises the loader's
    `CheckpointError` / `WeightShapeError` naming the file and tensor; `close` drops the file handles."""

    def __init__(self, directory: Path, config: ModelConfig) -> None:
        self.directory = directory
        self.config = config
        self.dtype = torch_dtype(config.dtype)
        self._files: CheckpointFiles | None = None
        self._raw: dict[Path, _File] = {}

    def read(self, piece: WeightPiece) -> dict[str, torch.Tensor]:
        if self._files is None:
            self._files = CheckpointFiles(self.directory)
        files = self._files
        table = tensor_table(self.config, piece)
        buffer = landing_buffer(table[-1].offset + table[-1].nbytes)
        tensors = {}
        for entry in table:
            place = buffer[entry.offset : entry.offset + entry.nbytes]
            tensor = place.view(self.dtype).view(entry.shape)
            path = files.check(entry.name, entry.shape)
            raw = self._raw.get(path)
            if raw is None:
                raw = self._raw[path] = _File(path)
            at = raw.span(entry.name, self.config.dtype, entry.shape, entry.nbytes)
            if at is not None:
                raw.read_into(place, at)
            else:
                tensor.copy_(files.read(entry.name, entry.shape))
            tensors[entry.name] = tensor
        return tensors

    def close(self) -> None:
        if self._files is not None:
            self._files.close()
            self._files = None
        for raw in self._raw.values():
            raw.close()
        self._raw.clear()
