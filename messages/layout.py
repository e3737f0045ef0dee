"""Pool layouts: named per-token buffers, as exchanged in the transfer handshake (architecture §4)."""

from __future__ import annotations

from typing import Literal

from messages.base import Record

DType = Literal["float32", "float16", "bfloat16", "int64", "int32", "uint8"]

DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "uint8": 1,
}


class BufferSpec(Record, frozen=True):
    """One named buffer: every token has a `shape`-shaped element of `dtype`."""

    name: str
    shape: tuple[int, ...]
    dtype: DType

    @property
    def elements_per_token(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @property
    def bytes_per_token(self) -> int:
        return self.elements_per_token * DTYPE_SIZES[self.dtype]


class PoolLayout(Record, frozen=True):
    """The buffers of a pool and its block size. Two pools can exchange blocks only if equal."""

    block_size: int
    buffers: tuple[BufferSpec, ...]

    @property
    def bytes_per_token(self) -> int:
        return sum(buffer.bytes_per_token for buffer in self.buffers)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def buffer(self, name: str) -> BufferSpec:
        for buffer in self.buffers:
            if buffer.name == name:
                return buffer
        raise KeyError(f"layout has no buffer {name!r}; it has {[b.name for b in self.buffers]}")

    def mismatch(self, other: PoolLayout) -> str | None:
        """A sentence naming the first difference from `other` (self = sender), or None when equal."""
        if self.block_size != other.block_size:
            return f"block_size mismatch: sender {self.block_size}, receiver {other.block_size}"
        mine = [b.name for b in self.buffers]
        theirs = [b.name for b in other.buffers]
        if mine != theirs:
            return f"layout buffers mismatch: sender {mine}, receiver {theirs}"
        for a, b in zip(self.buffers, other.buffers, strict=True):
            if a.shape != b.shape:
                return f"buffer {a.name!r} shape mismatch: sender {list(a.shape)}, receiver {list(b.shape)}"
            if a.dtype != b.dtype:
                return f"buffer {a.name!r} dtype mismatch: sender {a.dtype}, receiver {b.dtype}"
        return None
