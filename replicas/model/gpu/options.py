"""How an executor runs: the attention implementation, CUDA graphs, and the path it ended up on."""

from __future__ import annotations

from typing import Literal

# "auto": the Triton kernels on a CUDA device (when they pass their check), torch's SDPA elsewhere;
# "kernels": the Triton kernels wherever they run (a GPU, or Triton's interpreter on CPU: tests);
# "torch": SDPA over the gathered context everywhere.
AttentionChoice = Literal["auto", "kernels", "torch"]
# "auto": capture decode graphs when the executor runs the kernels on a CUDA device; "off": never.
GraphsChoice = Literal["auto", "off"]
# What `status` shows per replica: decode replayed from CUDA graphs, kernels launched eagerly, or torch.
ExecutorPath = Literal["graphs", "kernels", "eager"]

# Graphs are captured for batch sizes up to this many sequences; a larger batch runs the kernels eagerly.
MAX_GRAPH_BATCH = 256


def graph_buckets(max_batch: int) -> tuple[int, ...]:
    """The batch sizes decode graphs are captured for: 1, 2, 4, 8, then every 8 up to 64, every 16 up to
    128, every 32 beyond — up to `max_batch` (included, capped at `MAX_GRAPH_BATCH`). A batch of n
    sequences replays the smallest bucket ≥ n, its extra rows padded (they write nothing, attend to
    nothing, and their logits are dropped)."""
    if max_batch < 1:
        raise ValueError(f"graph_buckets: max_batch must be >= 1, got {max_batch}")
    top = min(max_batch, MAX_GRAPH_BATCH)
    sizes = [size for size in (1, 2, 4) if size < top]
    size = 8
    while size < top:
        sizes.append(size)
        size += 8 if size < 64 else 16 if size < 128 else 32
    sizes.append(top)
    return tuple(sizes)


def bucket_for(batch: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding `batch` sequences; None when the batch is larger than every bucket."""
    for size in buckets:
        if size >= batch:
            return size
    return None
