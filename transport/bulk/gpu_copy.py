"""One pass over a round's bytes on a GPU: groups of rows gathered from one buffer and scattered into
another by a single kernel, instead of `index_select` into a temporary and `index_copy_` out of it.

Measured on an H100 80GB HBM3, the index prebuilt: 512 shuffled 2 MiB blocks took 1.8–2.0 ms through
the temporary (every byte read and written twice) and 0.78–0.85 ms in one pass, 0.91–0.94 of one
contiguous `copy_` of the same GiB; a `copy_` per block costs about 10 µs of host time each. The
`gpu_copy_1GiB` row of `python -m engine.bench transfer --only gpu` times it with the index built in the
call.

The kernel is written in Triton, which torch's CUDA builds for Linux install as their own dependency
(torch.compile's code generator). `prepare(device)` builds and checks it once per device; an endpoint
on a GPU pool does so in a worker thread as it opens. `copy_groups` never compiles: until that build is
done (about a second, longer on a busy host), it copies through the temporary, so a first round neither
waits for the compiler nor blocks the event loop on it (a second's block there can break a link whose
peer waits a second for a heartbeat). Where Triton cannot be imported (CPU builds, other platforms), or
the kernel fails its check on the device, `copy_groups` always copies through the temporary — the same
bytes, one pass slower — and the log says why once (`transport.gpu_copy_two_pass`).

The copy is byte for byte: both buffers are viewed as the widest integer type that divides a group, so
no value passes through a float conversion (bfloat16 NaN payloads survive).
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any, Final, Protocol

import structlog
import torch
import trio

ELEMENTS_PER_PROGRAM: Final = 4096  # int64 elements (32 KiB) per kernel program: a 2 MiB group is 64
POLL_BYTES_PER_SECOND: Final = 500e9  # below what one H100 copies; past the time at this rate, a thread waits
POLL_SLACK_SECONDS: Final = 0.0005
_log = structlog.get_logger("transport.gpu_copy")
_INTEGER_VIEWS: Final = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def copy_groups(
    source: torch.Tensor, target: torch.Tensor, group: int, src: torch.Tensor, dst: torch.Tensor
) -> None:
    """Rows `[g * group, (g + 1) * group)` of flat, contiguous `source` for each `g` of `src` into the
    rows of `target` numbered by `dst` (same length), queued on the current stream. `src` and `dst` are
    int64 tensors on the buffers' device. Distinct `dst` entries are assumed (a grant's rows are). Uses
    the kernel once `prepare` has built it for the device, two passes until then."""
    kernel = _built.get(source.device) if source.device == target.device else None
    if kernel is None:
        _two_pass(source, target, group, src, dst)
        return
    group_bytes = group * source[0].numel() * source.element_size()
    itemsize, dtype = next((size, dtype) for size, dtype in _INTEGER_VIEWS if group_bytes % size == 0)
    elements = group_bytes // itemsize
    chunks = -(-elements // ELEMENTS_PER_PROGRAM)
    flat_source = source.view(-1).view(torch.uint8).view(dtype)
    flat_target = target.view(-1).view(torch.uint8).view(dtype)
    kernel[(src.numel() * chunks,)](
        flat_source, flat_target, src, dst, elements, chunks, ELEMENTS_PER_PROGRAM=ELEMENTS_PER_PROGRAM
    )


class CopyEvent(Protocol):
    """What `copies_done` waits on: a `torch.cuda.Event` recorded after the copies."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


async def copies_done(event: CopyEvent, nbytes: int) -> None:
    """Return once the work before `event` is done — copies of `nbytes` in all — even if cancelled
    meanwhile (then `Cancelled` is raised after it): the caller's write fence.

    It first polls the event between Trio turns, for as long as copies at `POLL_BYTES_PER_SECOND` (plus
    `POLL_SLACK_SECONDS`) would take, and only then waits in a worker thread. Against the thread alone
    this saved 80-290 µs per 1 GiB transfer on an H100 80GB HBM3 (a thread's wake-up, then the event
    loop's); polling costs the loop's turns for under a millisecond per GiB, and other tasks run between
    the polls."""
    poll_until = time.perf_counter() + nbytes / POLL_BYTES_PER_SECOND + POLL_SLACK_SECONDS
    try:
        while time.perf_counter() < poll_until:
            if event.query():
                return
            await trio.lowlevel.checkpoint()
    except trio.Cancelled:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(event.synchronize)
        raise
    await trio.to_thread.run_sync(event.synchronize)  # not abandoned: a cancellation waits for it
    await trio.lowlevel.checkpoint_if_cancelled()  # and is raised here, as when it came while polling


def indexed(device: torch.device) -> torch.device:
    """`device` with its index: an unindexed `cuda` is the calling thread's current device."""
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device())


# Kernels `prepare` has built (None: the device cannot use one), by indexed device; written under the lock.
_built: dict[torch.device, Any] = {}
_building = threading.Lock()


def prepare(device: torch.device) -> Any:
    """The kernel, built for `device` and checked there on three shuffled groups; None (logged once)
    where it cannot be used. Blocks while Triton compiles (about a second, once per process and device,
    less with Triton's disk cache); callers at the same time wait for the one build."""
    if device.type != "cuda":
        return None
    device = indexed(device)
    with _building:
        if device not in _built:
            _built[device] = _build(device)
        return _built[device]


def _build(device: torch.device) -> Any:
    """Triton compiles a kernel per integer view on first launch (about 0.1 s each on an H100 80GB HBM3):
    the check copy launches each here, so no launch of `copy_groups` compiles on the event loop."""
    kernel = _kernel()
    if kernel is None:
        return None
    elements = ELEMENTS_PER_PROGRAM + 3  # two chunks, the second partial
    order = torch.tensor([2, 0, 1], device=device)
    moved = True
    try:
        with torch.cuda.stream(torch.cuda.Stream(device)):  # the check waits for no one else's work
            for _itemsize, dtype in _INTEGER_VIEWS:
                source = torch.arange(3 * elements, device=device).to(dtype)
                target = torch.zeros_like(source)
                kernel[(3 * 2,)](
                    source,
                    target,
                    order,
                    torch.arange(3, device=device),
                    elements,
                    2,
                    ELEMENTS_PER_PROGRAM=ELEMENTS_PER_PROGRAM,
                )
                moved = moved and torch.equal(target.view(3, -1), source.view(3, -1)[order])
    except Exception as exc:  # noqa: BLE001 - Triton's compiler and driver raise many types; logged, two-pass
        _log.warning("transport.gpu_copy_two_pass", device=str(device), reason=f"{type(exc).__name__}: {exc}")
        return None
    if not moved:
        _log.warning(
            "transport.gpu_copy_two_pass", device=str(device), reason="the kernel's check copy differs"
        )
        return None
    return kernel


async def prepare_in_thread(device: torch.device) -> None:
    """`prepare(device)` in a worker thread (not abandoned) for a GPU `device`: an endpoint starts it as
    it opens, so its first round does not wait for the compiler, nor block the event loop on it."""
    if device.type == "cuda":  # indexed here: the event loop's current device, not the worker thread's
        await trio.to_thread.run_sync(prepare, indexed(device))


def _two_pass(
    source: torch.Tensor, target: torch.Tensor, group: int, src: torch.Tensor, dst: torch.Tensor
) -> None:
    # As 2-D `[groups, elements]` views: torch copies those slices whole (a 3-D view took twice as long
    # on CPU). Flat buffers are contiguous, so these are views.
    gathered = source.view(source.shape[0] // group, -1).index_select(0, src)
    target.view(target.shape[0] // group, -1).index_copy_(0, dst, gathered.to(target.device))


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, or None (logged once) where Triton cannot be imported."""
    try:
        import triton
        import triton.language as tl
    except Exception as exc:  # noqa: BLE001 - absent (ImportError) or broken on import: logged, two passes
        _log.info("transport.gpu_copy_two_pass", reason=f"triton cannot be imported: {exc!r}")
        return None

    # Not specialised on `elements` either: Triton would compile again for each of `== 1`, `% 16 == 0` and
    # other, at a round's launch; the copy measured the same for 64 KiB and 2 MiB groups, 0.89x for 4 KiB.
    @triton.jit(do_not_specialize=["chunks", "elements"])
    def copy_groups_kernel(
        source, target, src_groups, dst_groups, elements, chunks, ELEMENTS_PER_PROGRAM: tl.constexpr
    ):
        program = tl.program_id(0)
        entry, chunk = program // chunks, program % chunks
        src_group = tl.load(src_groups + entry)  # int64: offsets past 2**31 elements stay exact
        dst_group = tl.load(dst_groups + entry)
        offsets = chunk * ELEMENTS_PER_PROGRAM + tl.arange(0, ELEMENTS_PER_PROGRAM)
        inside = offsets < elements
        values = tl.load(source + src_group * elements + offsets, mask=inside)
        tl.store(target + dst_group * elements + offsets, values, mask=inside)

    return copy_groups_kernel
