"""A gate on a CUDA stream: work queued behind it waits until the test opens it (GPU tests only).

`GpuGate.close_on(stream)` launches a one-thread kernel that spins on a flag in device memory;
everything queued on that stream after it waits. `open()` sets the flag from another stream, and the
kernel ends. A test that needs "this copy has not run yet" at some point holds by construction, not by
how long a sleep kernel happens to last on this GPU. A safety cap ends the spin after about 2^26 reads
(seconds) so a broken test cannot hang the GPU.
"""

from __future__ import annotations

from typing import final

import torch
import triton
import triton.language as tl

_SPIN_CAP = 1 << 26


@triton.jit
def _spin(flag_ptr, spins_ptr, cap):
    spins = 0
    value = tl.load(flag_ptr, volatile=True)
    while (value == 0) & (spins < cap):
        value = tl.load(flag_ptr, volatile=True)
        spins += 1
    tl.store(spins_ptr, spins)


@final
class GpuGate:
    def __init__(self, device: torch.device) -> None:
        self._flag = torch.zeros(1, dtype=torch.int32, device=device)
        self._spins = torch.zeros(1, dtype=torch.int64, device=device)
        self._opener = torch.cuda.Stream(device=device)

    def close_on(self, stream: torch.cuda.Stream) -> None:
        """Queue the gate on `stream` (the flag is reset on `stream` first)."""
        with torch.cuda.stream(stream):
            self._flag.zero_()
            _spin[(1,)](self._flag, self._spins, _SPIN_CAP)

    def open(self) -> None:
        """Let the work behind the gate run (from a stream of its own, so it is not itself behind it)."""
        with torch.cuda.stream(self._opener):
            self._flag.fill_(1)

    def spins(self) -> int:
        """How many reads the gate made (after it ended): below the cap means it was opened."""
        return int(self._spins.item())
