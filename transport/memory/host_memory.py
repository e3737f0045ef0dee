"""Host memory for CPU pools, on transparent huge pages where the kernel offers them.

Copies walk a pool's pages: UCX's shared-memory transport reads the sender's pool from the receiver's
process (`process_vm_readv`), pinning every page it reads, and inproc and tcp copies take a TLB miss per
page. On 4 KiB pages 2 MiB messages moved at 5.7 GB/s on a 2-vCPU VM, on 2 MiB pages at 7.2 GB/s.

A pool buffer of at least 2 MiB is anonymous memory of its own (`mmap`), 2 MiB aligned. The kernel
zeroes each page at its first touch, so a pool takes resident memory only for the blocks that were ever
used (the allocator hands the lowest free ids out first: a pool sized for a whole context but used for
a few requests costs those requests' pages, not the context's). A huge page is resident whole once any
of its bytes is touched, so only a buffer of at least `HUGE_PAGE_BUFFER` (32 huge pages: the rounding
costs at most 1/32 of it) is advised `MADV_HUGEPAGE` (Linux; honoured with transparent huge pages
`always` or `madvise`); a smaller one `MADV_NOHUGEPAGE` — a small model's KV cache is many buffers of
a few MiB (one per layer, keys and values), and huge pages would make the first block of each cost
2 MiB. Elsewhere, or when the advice is refused, it is ordinary zeroed memory: huge pages are a speed-up,
never a requirement.

`landing_buffer(nbytes)` is host memory that a copy writes whole at once (a weight piece landing): its
whole huge pages are advised `MADV_HUGEPAGE` whatever its size — every byte of them is written, so a
huge page costs nothing a small one would not, and its first touch is one fault where 512 small pages
took 512 — and the rest `MADV_NOHUGEPAGE`, so the rounding is never resident.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys
from typing import Final

import torch

HUGE_PAGE: Final = 2 * 1024 * 1024
HUGE_PAGE_BUFFER: Final = 32 * HUGE_PAGE
_MADV_HUGEPAGE: Final = 14  # Linux's values
_MADV_NOHUGEPAGE: Final = 15


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor of `shape`, resident only where touched once it is 2 MiB or more, on huge
    pages from `HUGE_PAGE_BUFFER` on when the kernel agrees."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or sys.platform != "linux":
        return torch.zeros(shape, dtype=dtype)
    # Anonymous memory, zero until touched; the tensor keeps the mapping alive (`torch.frombuffer`).
    memory = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(memory, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    region = raw[start : start + nbytes]
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE  # within `raw`: the slack after the region is a page
    libc = ctypes.CDLL(None, use_errno=True)
    advice = _MADV_HUGEPAGE if nbytes >= HUGE_PAGE_BUFFER else _MADV_NOHUGEPAGE
    libc.madvise(ctypes.c_void_p(region.data_ptr()), ctypes.c_size_t(length), advice)
    return region.view(dtype).view(shape)


def landing_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes`, zero until written, its whole huge pages on huge pages where the
    kernel agrees (see the module docstring); ordinary memory below one huge page or off Linux."""
    if nbytes < HUGE_PAGE or sys.platform != "linux":
        return torch.empty(nbytes, dtype=torch.uint8)
    memory = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(memory, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    region = raw[start : start + nbytes]
    huge = nbytes // HUGE_PAGE * HUGE_PAGE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise(ctypes.c_void_p(region.data_ptr()), ctypes.c_size_t(huge), _MADV_HUGEPAGE)
    if huge < nbytes:
        tail = -(-(nbytes - huge) // HUGE_PAGE) * HUGE_PAGE  # within `raw`: the slack after the region
        libc.madvise(ctypes.c_void_p(region.data_ptr() + huge), ctypes.c_size_t(tail), _MADV_NOHUGEPAGE)
    return region


# glibc's mallopt parameters
_M_TRIM_THRESHOLD: Final = -1
_M_MMAP_THRESHOLD: Final = -3
_M_ARENA_MAX: Final = -8
MMAP_THRESHOLD: Final = 32 << 20  # glibc's own ceiling for its dynamic threshold on 64-bit
TRIM_THRESHOLD: Final = 2 * MMAP_THRESHOLD  # what glibc pairs with it
ARENA_MAX: Final = 2


def tune_allocator() -> bool:
    """glibc: fix the heap's behaviour at what it settles to on its own, from the start, and bound it.

    An allocation of `MMAP_THRESHOLD` bytes or more is mapped on its own and unmapped when freed; smaller
    ones come from the heap, which keeps up to `TRIM_THRESHOLD` bytes free at its top for the next
    allocations instead of returning them; the threads share `ARENA_MAX` heaps (glibc's default: 8 per
    core, each keeping its own free memory). A decode step or a prefill batch allocates the same
    temporaries every time — a gather of every sequence's KV rows, activations of a few MiB — and a
    temporary that is mapped afresh costs a page fault per 4 KiB page at its first touch: with a 1 MiB
    threshold those faults made a tiny model's decode steps three times slower (docs/model.md). The
    mallopt calls also keep glibc from moving the thresholds on its own. Called once by the node at
    start; True when set (False where the C library is not glibc)."""
    if sys.platform != "linux":
        return False
    libc = ctypes.CDLL(None)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    return all(
        mallopt(parameter, value) == 1
        for parameter, value in (
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (_M_ARENA_MAX, ARENA_MAX),
        )
    )
