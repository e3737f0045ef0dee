"""Where a replica's own copy of the weights comes from: the `Source` protocol, and the host and disk
sources (the peer source is `replicas.loading.peer_receive`).

A source's `fetch(piece)` returns the piece's checkpoint tensors (HF names) in memory of their own — the
builder may keep them as they are — or a layer already fused in the replica's layout (the host copy of a
CPU model), or raises `SourceFailed` naming the source, the piece and why.
`aclose` releases what it holds. Fetches run in worker threads (file reads, host-to-device copies);
a cancelled fetch waits for its thread (threads are never abandoned) and then raises `Cancelled`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, final

import torch
import trio
from safetensors import SafetensorError

from messages.log.scaling import WeightsSourceName
from messages.weights import WeightPiece
from replicas.loading.disk import DiskReader
from replicas.loading.host_copy import HostCopy
from replicas.model.config import ModelConfig
from replicas.model.errors import ModelLoadError
from replicas.model.layers import LayerWeights


@final
class SourceFailed(Exception):
    """`source` could not deliver `piece`; `reason` says why (the message names all three)."""

    def __init__(self, source: WeightsSourceName, piece: WeightPiece, reason: str) -> None:
        super().__init__(f"source {source} failed at {piece.label}: {reason}")
        self.source, self.piece, self.reason = source, piece, reason


class Source(Protocol):
    name: WeightsSourceName

    async def fetch(self, piece: WeightPiece) -> dict[str, torch.Tensor] | LayerWeights: ...

    async def aclose(self) -> None: ...


@final
class HostSource:
    """The node's host-memory copy (`HostCopy`): each tensor copied to the replica's device."""

    name: WeightsSourceName = "host"

    def __init__(self, host: HostCopy, device: torch.device) -> None:
        self.host = host
        self.device = device

    async def fetch(self, piece: WeightPiece) -> dict[str, torch.Tensor] | LayerWeights:
        return await trio.to_thread.run_sync(self._copy, piece)

    def _copy(self, piece: WeightPiece) -> dict[str, torch.Tensor] | LayerWeights:
        fused = None if piece.layer is None or self.device.type != "cpu" else self.host.fused(piece.layer)
        if fused is not None:  # already fused and packed as a CPU replica serves it: copy it as it is
            return fused.clone()
        try:
            tensors = self.host.read(piece)
        except KeyError:
            raise SourceFailed("host", piece, "the node's host copy lacks it") from None
        # `copy=True`: a fresh tensor even on the CPU, where `to` would return the host copy itself.
        return {name: tensor.to(self.device, copy=True) for name, tensor in tensors.items()}

    async def aclose(self) -> None:
        return None


@final
class DiskSource:
    """The checkpoint files (`replicas.loading.disk`). `fill`: the node's host copy while it is not
    complete (the first load of the model from disk may be a replica's own copy): each piece read goes
    into it too, in memory other than the replica's."""

    name: WeightsSourceName = "disk"

    def __init__(
        self, directory: Path, config: ModelConfig, device: torch.device, *, fill: HostCopy | None = None
    ) -> None:
        self.reader = DiskReader(directory, config)
        self.device = device
        self.fill = fill

    async def fetch(self, piece: WeightPiece) -> dict[str, torch.Tensor]:
        return await trio.to_thread.run_sync(self._read, piece)

    def _read(self, piece: WeightPiece) -> dict[str, torch.Tensor]:
        try:
            tensors = self.reader.read(piece)
        except (ModelLoadError, SafetensorError, OSError) as exc:
            raise SourceFailed("disk", piece, f"{self.reader.directory}: {exc}") from exc
        if self.fill is not None:
            self.fill.put(piece, {name: tensor.clone() for name, tensor in tensors.items()})
        return {name: tensor.to(self.device) for name, tensor in tensors.items()}

    async def aclose(self) -> None:
        await trio.to_thread.run_sync(self.reader.close)
