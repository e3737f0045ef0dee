"""What a cuda-ipc receiver tells its sender before the link's handshake (`transport.links.cuda_ipc.link`).

The receiver shares its pool: for each buffer tensor, the CUDA IPC handle of the allocation it lives in
and where in it the tensor starts, as `torch.multiprocessing.reductions.reduce_tensor` describes it. The
sender opens the handles (same host only, checked by `host`) and answers with a verdict.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from messages.base import Message, Record
from messages.layout import DType

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class SharedBuffer(Record, frozen=True):
    """One buffer tensor of the receiver's pool, as a CUDA IPC handle and a view into its allocation."""

    name: str
    dtype: DType
    shape: tuple[NonNegative, ...]
    stride: tuple[NonNegative, ...]
    offset: NonNegative  # elements from the start of the storage
    device: NonNegative
    handle: bytes
    storage_bytes: NonNegative
    storage_offset: NonNegative  # bytes from the start of the CUDA allocation
    ref_counter_handle: bytes
    ref_counter_offset: NonNegative
    event_handle: bytes | None
    event_sync_required: bool


class PoolShare(Message, frozen=True, tag="pool_share"):
    """Receiver → sender, first thing on a cuda-ipc connection."""

    host: str  # hostname and boot id: CUDA IPC handles open only on the host that made them
    pid: int
    buffers: tuple[SharedBuffer, ...]


class ShareVerdict(Message, frozen=True, tag="share_verdict"):
    """Sender → receiver: the pool is mapped (`refusal` None), or why not, as a sentence."""

    refusal: str | None
