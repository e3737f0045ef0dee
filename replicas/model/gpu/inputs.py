"""The per-step inputs of a decode batch, in device buffers allocated once per executor.

A decode step needs, per sequence: the token fed, its rotary position, the cache row its K/V land in
(its *slot*), how many tokens it attends to, and its block table. `DecodeInputs.fill` writes them into
pinned host buffers (numpy views: no tensor is built per step) and sends them with two asynchronous
copies; the step's kernels read the device buffers through views that never move, which is what lets a
CUDA graph captured once replay every step.

Padding: rows `[n, bucket)` of a bucket get token 0, position 0, slot -1 (the KV write skips it) and
context length 0 (attention returns zeros): they change no cache row, and the logits of real rows do not
depend on them where the kernels are batch-invariant (`--batch-invariant`); otherwise only through the
matmul's choice of kernel for the bucket's size, as any batch does.

Invariant: between `fill` and the step's end (its one read of the sampled tokens) nothing else writes
the buffers; one executor runs one step at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, final

import numpy as np
import torch

# Rows of the packed scalar buffer.
_TOKEN, _POSITION, _SLOT, _CONTEXT = range(4)


class DecodeRow(Protocol):
    """What `fill` reads of a sequence (`replicas.model.executor.batch.DecodeSequence` has it)."""

    @property
    def block_table(self) -> Sequence[int]: ...
    @property
    def cached_tokens(self) -> int: ...
    @property
    def token_id(self) -> int: ...
    @property
    def position(self) -> int | None: ...


@final
class DecodeInputs:
    """Buffers for up to `max_batch` sequences of up to `max_blocks` blocks each."""

    def __init__(self, *, max_batch: int, max_blocks: int, block_size: int, device: torch.device) -> None:
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.device = device
        pin = device.type == "cuda"
        self._host_scalars = torch.zeros((4, max_batch), dtype=torch.int32, pin_memory=pin)
        self._host_tables = torch.zeros((max_batch, max_blocks), dtype=torch.int32, pin_memory=pin)
        self._scalars_np = self._host_scalars.numpy()
        self._tables_np = self._host_tables.numpy()
        self.scalars = torch.zeros((4, max_batch), dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((max_batch, max_blocks), dtype=torch.int32, device=device)
        self.token_ids = self.scalars[_TOKEN]
        self.positions = self.scalars[_POSITION]
        self.slots = self.scalars[_SLOT]
        self.context_lens = self.scalars[_CONTEXT]
        self.pad(max_batch)

    def pad(self, bucket: int) -> None:
        """Every row of `[0, bucket)` a padded row (graph capture runs on these)."""
        self._scalars_np[:, :bucket] = 0
        self._scalars_np[_SLOT, :bucket] = -1
        self._tables_np[:bucket, :] = 0
        self._send(bucket, self.max_blocks)

    def fill(self, rows: Sequence[DecodeRow], bucket: int) -> None:
        """Write `rows` into rows `[0, len(rows))`, pad `[len(rows), bucket)`, send both to the device.

        The caller checked every row (block ids in range, tables long enough, `len(rows) <= bucket <=
        max_batch`). Costs a Python loop over the rows and two asynchronous copies; no device read."""
        n = len(rows)
        bs = self.block_size
        scalars, tables = self._scalars_np, self._tables_np
        width = 1
        for index, row in enumerate(rows):
            cached = row.cached_tokens
            table = row.block_table
            used = cached // bs + 1
            scalars[_TOKEN, index] = row.token_id
            scalars[_POSITION, index] = cached if row.position is None else row.position
            scalars[_SLOT, index] = table[cached // bs] * bs + cached % bs
            scalars[_CONTEXT, index] = cached + 1
            tables[index, :used] = table[:used]
            width = max(width, used)
        scalars[:, n:bucket] = 0
        scalars[_SLOT, n:bucket] = -1
        self._send(bucket, width)

    def _send(self, bucket: int, width: int) -> None:
        self.scalars[:, :bucket].copy_(self._host_scalars[:, :bucket], non_blocking=True)
        self.block_tables[:bucket, :width].copy_(self._host_tables[:bucket, :width], non_blocking=True)

    def host_view(self, bucket: int) -> np.ndarray:
        """The host copy of the scalar rows of `[0, bucket)` (tests read what was sent)."""
        return self._scalars_np[:, :bucket]
