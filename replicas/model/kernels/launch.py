"""One lock around every kernel launch of this package, for the executors' worker threads.

Replicas of a node run their executors in worker threads at once. Two things in Triton are not safe to
enter from several threads: its interpreter (`TRITON_INTERPRET=1`, the CPU tests) patches
`triton.language` for the length of a launch, and the first launch of a kernel parses its source with
`ast.parse`, which CPython 3.11 does not make thread-safe ("SystemError: AST constructor recursion depth
mismatch" when two threads parse at once). A compiled launch costs microseconds under the GIL anyway;
serialising it costs nothing measurable, and the first compile of a kernel holds the lock (seconds, once
per process and shape).
"""

from __future__ import annotations

import threading

import triton

LAUNCH_LOCK = threading.Lock()


@triton.jit
def _probe() -> None:
    """Never launched: `triton.jit` decorates it as it decorates every kernel of this package, reading
    `TRITON_INTERPRET` when this module is imported."""


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (`TRITON_INTERPRET=1`): the only way they run on
    CPU tensors."""
    return type(_probe).__name__ == "InterpretedFunction"
