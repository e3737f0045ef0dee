"""Block storage: one preallocated tensor per named buffer of a pool layout (architecture §4).

The allocator (`transport.memory.blocks.BlockPool`) knows which block ids belong to whom; this module holds
the bytes. Buffer `name` is a tensor of shape `[num_blocks, block_size, *spec.shape]`, so block `b` of a
buffer is one contiguous run of `block_size * bytes_per_token` bytes — what transports copy or
`recv_into` directly.

A storage may also be laid over tensors its caller owns (`over`): a receive then lands straight in them
(`TransferEndpoint.receive(..., into=...)`), e.g. a weight piece's own buffer, so nothing is copied
out of a staging pool afterwards.

Token `t` of an allocation `ids` lives in block `ids[t // block_size]`, row `t % block_size`. Gather and
scatter address tokens through that rule, vectorised: one index computation and one `index_select` /
`index_copy_` per buffer, no Python loop per token or per block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import final

import torch

from messages.layout import BufferSpec, PoolLayout
from transport.memory.host_memory import zeroed_host_tensor

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}


def torch_dtype(name: str) -> torch.dtype:
    return TORCH_DTYPES[name]


def token_rows(
    ids: Sequence[int], block_size: int, start: int, count: int, device: torch.device
) -> torch.Tensor:
    """Flat row indices (`block * block_size + row`) of tokens `[start, start + count)` of allocation `ids`."""
    if start < 0 or count < 0 or start + count > len(ids) * block_size:
        raise ValueError(
            f"token range [{start}, {start + count}) outside an allocation of {len(ids)} blocks "
            f"of {block_size} tokens"
        )
    tokens = torch.arange(start, start + count, dtype=torch.int64)
    blocks = torch.as_tensor(list(ids), dtype=torch.int64)
    rows = blocks[tokens // block_size] * block_size + tokens % block_size
    return rows.to(device)


def _laid_over(
    spec: BufferSpec, shape: tuple[int, ...], tensor: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """`tensor` viewed as buffer `spec` of `shape`; `ValueError` when it is absent or does not fit."""
    count = 1
    for dim in shape:
        count *= dim
    if tensor is None:
        raise ValueError(f"storage over given tensors: buffer {spec.name!r} has none")
    if (
        tensor.dtype != torch_dtype(spec.dtype)
        or tensor.device.type != device.type
        or device.index not in (None, tensor.device.index)
        or not tensor.is_contiguous()
        or tensor.numel() != count
    ):
        raise ValueError(
            f"storage over given tensors: buffer {spec.name!r} needs {count} contiguous {spec.dtype} "
            f"elements on {device}, got {tensor.numel()} {tensor.dtype} on {tensor.device}"
        )
    return tensor.view(shape)


@final
class PoolStorage:
    """The tensors behind one pool. Never aliased with another pool's storage.

    `over`: lay the pool over these tensors (one per buffer of `layout`, each contiguous, on `device`,
    of exactly `num_blocks` blocks' elements, in the buffer's dtype) instead of allocating; they are
    neither zeroed nor pinned. A `ValueError` names the first that does not fit."""

    def __init__(
        self,
        layout: PoolLayout,
        num_blocks: int,
        *,
        device: str | torch.device = "cpu",
        pin_memory: bool = False,
        over: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = layout.block_size
        self.device = torch.device(device)
        self.tensors: dict[str, torch.Tensor] = {}
        self._bytes: dict[str, memoryview] = {}
        self._flat: dict[str, torch.Tensor] = {}
        self.row_bytes: dict[str, int] = {spec.name: spec.bytes_per_token for spec in layout.buffers}
        for spec in layout.buffers:
            shape = (num_blocks, layout.block_size, *spec.shape)
            if over is not None:
                self.tensors[spec.name] = _laid_over(spec, shape, over.get(spec.name), self.device)
                continue
            if self.device.type == "cpu":
                tensor = zeroed_host_tensor(shape, torch_dtype(spec.dtype))
            else:
                tensor = torch.zeros(shape, dtype=torch_dtype(spec.dtype), device=self.device)
            if pin_memory and self.device.type == "cpu" and torch.cuda.is_available():
                tensor = tensor.pin_memory()
            self.tensors[spec.name] = tensor

    def spec(self, name: str) -> BufferSpec:
        return self.layout.buffer(name)

    def flat(self, name: str) -> torch.Tensor:
        """Buffer `name` viewed as `[num_blocks * block_size, *shape]` (one row per token slot); the
        view is made once (a `view` call costs microseconds, and transports ask for it every round)."""
        view = self._flat.get(name)
        if view is None:
            tensor = self.tensors[name]
            view = tensor.view(self.num_blocks * self.block_size, *tensor.shape[2:])
            self._flat[name] = view
        return view

    def block_bytes(self, name: str, block_id: int) -> memoryview:
        """The raw bytes of one block of one buffer (CPU storage only), writable in place."""
        if self.device.type != "cpu":
            raise ValueError(f"block_bytes needs CPU storage, this pool is on {self.device}")
        block = self.tensors[name][block_id]
        return memoryview(block.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]

    def buffer_bytes(self, name: str) -> memoryview:
        """All bytes of buffer `name` (CPU storage only), writable in place and cached.

        Flat row `r` (see `flat`) is bytes `[r * bytes_per_token, (r + 1) * bytes_per_token)`.
        """
        view = self._bytes.get(name)
        if view is None:
            if self.device.type != "cpu":
                raise ValueError(f"buffer_bytes needs CPU storage, this pool is on {self.device}")
            flat_bytes = self.tensors[name].view(-1).view(torch.uint8)
            view = memoryview(flat_bytes.numpy()).cast("B")  # type: ignore[arg-type]
            self._bytes[name] = view
        return view

    def gather(
        self, ids: Sequence[int], start: int, count: int, names: Sequence[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """Tokens `[start, start + count)` of allocation `ids`, one fresh `[count, *shape]` tensor per buffer."""
        rows = token_rows(ids, self.block_size, start, count, self.device)
        return {name: self.flat(name).index_select(0, rows) for name in (names or self.tensors)}

    def scatter(self, ids: Sequence[int], start: int, data: Mapping[str, torch.Tensor]) -> None:
        """Write `data[name]` (`[count, *shape]`) into tokens `[start, start + count)` of allocation `ids`."""
        counts = {int(tensor.shape[0]) for tensor in data.values()}
        if len(counts) != 1:
            raise ValueError(f"scatter: buffers disagree on token count: {sorted(counts)}")
        (count,) = counts
        rows = token_rows(ids, self.block_size, start, count, self.device)
        for name, tensor in data.items():
            target = self.flat(name)
            if tuple(tensor.shape[1:]) != tuple(target.shape[1:]):
                raise ValueError(
                    f"scatter: buffer {name!r} expects per-token shape {list(target.shape[1:])}, "
                    f"got {list(tensor.shape[1:])}"
                )
            target.index_copy_(0, rows, tensor.to(device=target.device, dtype=target.dtype))

    def fill_blocks(self, ids: Sequence[int], value: float) -> None:
        """Set every token slot of blocks `ids` in every buffer to `value` (tests poison blocks with it)."""
        index = torch.as_tensor(list(ids), dtype=torch.int64, device=self.device)
        for tensor in self.tensors.values():
            tensor.index_fill_(0, index, value)

    def memory_ranges(self) -> list[tuple[int, int]]:
        """`[start, end)` address ranges of every buffer (used to prove two pools never alias)."""
        ranges = []
        for tensor in self.tensors.values():
            start = tensor.data_ptr()
            ranges.append((start, start + tensor.numel() * tensor.element_size()))
        return ranges

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
