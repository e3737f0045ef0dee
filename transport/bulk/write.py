"""A bulk write: which tokens of the sender's allocation go to which tokens of the receiver's blocks, for
which buffers, and for which grant (`landing_key`, `round`). Every link's `write` takes one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from transport.bulk.runs import Run, check_ranges, plan_runs
from transport.memory.storage import PoolStorage


@dataclass(frozen=True, slots=True, kw_only=True)
class BulkWrite:
    """Tokens `[source_offset, +count)` of the sender's allocation `source_ids` in `source` storage go to
    tokens `[dest_offset, +count)` of the receiver's blocks `dest_ids`, for buffers `buffers` only.

    `landing_key` and `round` name the grant the bytes belong to, so the receiver can check them against
    it and discard the bytes of an aborted round.
    """

    source: PoolStorage
    source_ids: Sequence[int]
    source_offset: int
    dest_ids: Sequence[int]
    dest_offset: int
    count: int
    buffers: tuple[str, ...]
    landing_key: int
    round: int
    corrupt: bool = False
    nbytes: int = field(init=False)  # bytes the write moves (all selected buffers)
    _runs: list[Run] | None = field(init=False, default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Checks both token ranges (a `ValueError` names the side); plans no run yet."""
        check_ranges(*self._span())
        row_bytes = self.source.row_bytes
        object.__setattr__(self, "nbytes", self.count * sum(row_bytes[name] for name in self.buffers))

    @property
    def runs(self) -> list[Run]:
        """The write's runs (`plan_runs`), planned at the first use: a cuda-ipc round of whole blocks
        needs none (`whole_blocks`), and 512 blocks take 100-200 µs to plan."""
        if self._runs is None:
            runs = plan_runs(*self._span())
            object.__setattr__(self, "_runs", runs)
            return runs
        return self._runs

    def _span(self) -> tuple[Sequence[int], int, Sequence[int], int, int, int]:
        """The arguments `check_ranges` and `plan_runs` take, in their order."""
        return (
            self.source_ids,
            self.source_offset,
            self.dest_ids,
            self.dest_offset,
            self.count,
            self.source.block_size,
        )

    def whole_blocks(self) -> tuple[Sequence[int], Sequence[int]] | None:
        """The source and destination blocks paired in order when the write moves whole blocks (both
        offsets and the count are multiples of the block size); None otherwise."""
        size = self.source.block_size
        if self.source_offset % size or self.dest_offset % size or self.count % size:
            return None
        blocks, first_src, first_dst = (
            self.count // size,
            self.source_offset // size,
            self.dest_offset // size,
        )
        return (
            self.source_ids[first_src : first_src + blocks],
            self.dest_ids[first_dst : first_dst + blocks],
        )
