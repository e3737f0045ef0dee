"""Host pool memory: zeroed, the requested shape and dtype, large buffers 2 MiB aligned and resident only
where touched."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from messages.layout import BufferSpec, PoolLayout
from transport.memory.host_memory import HUGE_PAGE, zeroed_host_tensor
from transport.memory.storage import PoolStorage


def test_small_buffer_is_ordinary_zeroed_memory() -> None:
    tensor = zeroed_host_tensor((3, 5), torch.float32)
    assert tensor.shape == (3, 5)
    assert tensor.dtype == torch.float32
    assert not tensor.any()


def test_large_buffer_is_aligned_to_a_huge_page_and_zeroed() -> None:
    shape = (3, 16, 32768)  # 3 MiB of bfloat16: not a whole number of huge pages
    tensor = zeroed_host_tensor(shape, torch.bfloat16)
    assert tensor.shape == shape
    assert tensor.dtype == torch.bfloat16
    assert tensor.is_contiguous()
    assert tensor.data_ptr() % HUGE_PAGE == 0
    assert not tensor.any()
    last_bytes = tensor.view(-1).view(torch.uint8)
    last_bytes[-1] = 7  # the last byte is inside the allocation
    assert int(last_bytes[-1]) == 7


def test_pool_buffers_live_in_host_memory_of_their_own() -> None:
    layout = PoolLayout(block_size=16, buffers=(BufferSpec(name="embeds", shape=(4096,), dtype="float32"),))
    first, second = PoolStorage(layout, 8), PoolStorage(layout, 8)
    assert first.tensors["embeds"].shape == (8, 16, 4096)
    assert first.tensors["embeds"].data_ptr() % HUGE_PAGE == 0
    first.tensors["embeds"].fill_(1.0)
    assert not second.tensors["embeds"].any()


def resident_kib() -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status")
def test_a_large_buffer_is_resident_only_where_touched() -> None:
    """A pool sized for a whole context costs the pages its used blocks touched, not its size."""
    before = resident_kib()
    tensor = zeroed_host_tensor((256, 1 << 20), torch.uint8)  # 256 MiB
    assert resident_kib() - before < 64 * 1024
    tensor[:8].fill_(1)  # 8 MiB
    grown = resident_kib() - before
    assert 8 * 1024 <= grown < 64 * 1024
    assert not tensor[8:].any() and int(tensor[7, -1]) == 1
