"""Does a copy fit? The memory a device has available, and the refusal that names the bytes.

A copy that would not fit is refused before it starts (`replicas.loading.copy`): the probe reads what
the device has available — on the CPU the kernel's `MemAvailable` (`/proc/meminfo`), on CUDA
`torch.cuda.mem_get_info` — and the copy's bytes are the model's in the serving dtype. A probe that
cannot tell (another OS) returns None, and the copy goes ahead. Copies may be given another probe
(tests do). Synchronous and quick: nothing to cancel.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

MemoryProbe = Callable[[torch.device], int | None]
MEMINFO = Path("/proc/meminfo")


def available_memory(device: torch.device) -> int | None:
    """Bytes available on `device` now (None: unknown)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def refusal(needed: int, device: torch.device, probe: MemoryProbe) -> str | None:
    """Why a copy of `needed` bytes onto `device` cannot start (None: it fits, or no one can tell)."""
    available = probe(device)
    if available is None or needed <= available:
        return None
    where = "MemAvailable" if device.type == "cpu" else "free device memory"
    return (
        f"the copy needs {needed} bytes ({gib(needed)}) on {device}, but only {available} bytes "
        f"({gib(available)}, {where}) are available; free memory (scale a replica down to Inactive) or "
        "use a smaller dtype"
    )
