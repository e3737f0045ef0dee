"""What a weight load reports: each landed piece, the outcome of a copy, and the replica's weights status.

`PieceLoaded` goes to the replica (`on_piece`) after each piece; `CopyOutcome` is what `copy_weights`
returns; `WeightsStatus` is what `status` shows of a replica's weights (its snapshot's `weights_source`,
`loaded_layers`, `total_layers`, `weights_bytes_loaded`), kept by the replica's main loop. Plain values:
nothing to cancel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

from messages.control import SourceChoice, WeightsSource
from messages.log.scaling import WeightsFallback, WeightsSourceName
from messages.weights import WeightPiece
from replicas.model.llama import Model
from replicas.states import REVIVING_STATE

AUS_STATES = frozenset(state.value for state in REVIVING_STATE.values())


@final
@dataclass(frozen=True, slots=True)
class PieceLoaded:
    """`piece` landed from `source`: its `bytes` (serving dtype) in `seconds` (pacing included); the
    model now has `loaded_layers` of `total_layers` leading layers and `bytes_loaded` bytes."""

    piece: WeightPiece
    source: WeightsSourceName
    bytes: int
    seconds: float
    loaded_layers: int
    total_layers: int
    bytes_loaded: int


@final
@dataclass(frozen=True, slots=True)
class CopyOutcome:
    """A finished copy: the replica's own `model`; `source` loaded its last piece, `sources` every piece
    (in order, each named once); `fallbacks` the sources given up on the way; `peer` the replica a peer
    copy read from (None: no peer took part); `bytes` the pieces' bytes; `seconds` the copy's time."""

    model: Model
    source: WeightsSourceName
    sources: tuple[WeightsSourceName, ...]
    fallbacks: tuple[WeightsFallback, ...]
    peer: str | None
    bytes: int
    seconds: float


@final
class WeightsStatus:
    """A replica's weights as `status` shows them. Written by the replica's main loop only."""

    def __init__(self, total_layers: int) -> None:
        self.total_layers = total_layers
        self.requested: SourceChoice | None = None  # the source the last `Transition` named
        self.upstream: str | None = None  # the replica before it in a chain, the last `Transition` named
        self.source: WeightsSource | None = None
        self.loaded_layers = 0
        self.bytes_loaded = 0

    def commanded(self, to: str, source: SourceChoice | None, upstream: str | None = None) -> None:
        """A `Transition` to `to` arrived: a `Loading*` state loads from `source` (None: share the node's
        resident copy), through the chain from `upstream` when given; a revived replica (`Aus*`) serves
        the weights it kept, now `resident`."""
        self.requested, self.upstream = source, upstream
        if to in AUS_STATES and self.source is not None:
            self.source = "resident"

    def loading(self) -> SourceChoice | None:
        """A load starts: nothing is loaded yet; returns the source to load from."""
        self.source, self.loaded_layers, self.bytes_loaded = None, 0, 0
        return self.requested

    def landed(self, piece: PieceLoaded, *, shared: bool) -> None:
        self.source = "resident" if shared else piece.source
        self.loaded_layers, self.bytes_loaded = piece.loaded_layers, piece.bytes_loaded

    def loaded(self, model: Model, source: WeightsSource) -> None:
        self.source = source
        self.loaded_layers = model.loaded_layers
        self.bytes_loaded = model.parameter_bytes()

    def released(self) -> None:
        self.source, self.loaded_layers, self.bytes_loaded = None, 0, 0
