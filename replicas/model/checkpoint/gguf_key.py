"""What a GGUF file's conversion is keyed by: its size and a hash of its header, read without parsing it.

The header — magic, version, the metadata key/value pairs (tokenizer included) and the tensor infos
(names, shapes, types, offsets) — ends where the tensor data begins, at the alignment after the last
tensor info. `header_key(path)` walks it with `struct` (the value types' sizes; arrays of strings one
length at a time), so it costs a fraction of a second where `GGUFReader` takes seconds, and hashes
those bytes with SHA-256. Two files with the same size and header — the same file installed twice, in
two virtualenvs — share a key, and so a conversion; a file whose metadata, shapes or types changed gets
another. (The tensor data itself is not hashed: a file rewritten with other weights of the same shapes
and types keeps its key; the size, shapes and types are what a conversion's layout depends on.)
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Final, final

from replicas.model.errors import CheckpointError

GGUF_MAGIC: Final = b"GGUF"
DEFAULT_ALIGNMENT: Final = 32
# Value type → its size in bytes (8: string, 9: array, read with their lengths).
_SIZES: Final = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32, _UINT64 = 8, 9, 4, 10
_HEADER_CHUNK: Final = 1 << 20


@final
@dataclass(frozen=True, slots=True)
class GGUFKey:
    """A file's size and the SHA-256 of its header (hex)."""

    size: int
    header_sha256: str

    @property
    def short(self) -> str:
        return self.header_sha256[:16]


@final
class _Header:
    """The header's bytes, read from the file in chunks as the walk needs them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = path.open("rb")
        self.data = bytearray()
        self.position = 0

    def take(self, count: int) -> memoryview:
        end = self.position + count
        while len(self.data) < end:
            chunk = self.file.read(max(_HEADER_CHUNK, end - len(self.data)))
            if not chunk:
                raise CheckpointError(f"{self.path}: not a readable GGUF file: the header is cut off")
            self.data += chunk
        view = memoryview(self.data)[self.position : end]
        self.position = end
        return view

    def number(self, fmt: str) -> int:
        return int(struct.unpack_from("<" + fmt, self.take(struct.calcsize(fmt)))[0])

    def string(self) -> bytes:
        return bytes(self.take(self.number("Q")))

    def skip_value(self, kind: int) -> None:
        if kind == _STRING:
            self.take(self.number("Q"))
        elif kind == _ARRAY:
            item, count = self.number("I"), self.number("Q")
            if item in _SIZES:
                self.take(_SIZES[item] * count)
            else:
                for _ in range(count):
                    self.skip_value(item)
        elif kind in _SIZES:
            self.take(_SIZES[kind])
        else:
            raise CheckpointError(f"{self.path}: not a readable GGUF file: unknown value type {kind}")


def header_key(path: str | Path) -> GGUFKey:
    """`path`'s `GGUFKey`. Raises `CheckpointError` for a file that is not a GGUF file."""
    path = Path(path)
    try:
        header = _Header(path)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the GGUF file: {exc.strerror or exc}") from exc
    with header.file:
        if bytes(header.take(4)) != GGUF_MAGIC:
            raise CheckpointError(f"{path}: not a readable GGUF file: no GGUF magic")
        version = header.number("I")
        if version < 2:
            raise CheckpointError(f"{path}: GGUF version {version} is not supported (2 or later)")
        tensors, pairs = header.number("Q"), header.number("Q")
        alignment = DEFAULT_ALIGNMENT
        for _ in range(pairs):
            key, kind = header.string(), header.number("I")
            if key == b"general.alignment" and kind == _UINT32:
                alignment = header.number("I")
            else:
                header.skip_value(kind)
        for _ in range(tensors):
            header.string()
            dims = header.number("I")
            header.take(8 * dims + 4 + 8)  # dimensions, type, offset
        end = -(-header.position // alignment) * alignment
        digest = hashlib.sha256(header.data[: header.position]).hexdigest()
        size = path.stat().st_size
    if end > size:
        raise CheckpointError(f"{path}: not a readable GGUF file: the header runs past the end")
    return GGUFKey(size=size, header_sha256=digest)
