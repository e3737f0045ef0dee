"""The executor's fast path: paged-attention kernels, per-step inputs in preallocated device buffers,
device-side sampling and CUDA graphs per batch-size bucket (docs/gpu.md).

`Executor` (replicas/model/executor/) picks a path per replica and reports it (`ExecutorPath`):
`graphs` (kernels, decode steps replayed from CUDA graphs), `kernels` (the same kernels launched
eagerly), `eager` (torch's SDPA over gathered context; the CPU path). A path that fails its check at
start-up falls back to the next one with a logged reason; it never serves wrong tokens.
"""
